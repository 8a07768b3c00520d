"""The masked INT2 page layout (``code_layout_ref``) in Triton: reads as planar bytes, writes per token.

The Triton kernels compute on planar code rows (plane i of a row's 32 bytes holds channels
[32 i, 32 i + 32)); over a masked page (INT2, head_dim 128, pages of a multiple of 16 tokens,
``formats.cache.code_layout``) they load through :func:`load_code_bytes`, which gathers the
codes of a token row from its 16-token block and returns the planar bytes the row would have
held, so the arithmetic after the load is the planar one, unchanged. Flat pool row ``row`` =
(page * H_kv + head) * P + row in page; its block starts at row ``row - row % 16``.

Writes of one token (a demotion, or a bulk row) go through :func:`store_key_codes` and
:func:`store_value_codes`, from its unpacked codes [R, 128]:
- values: a token owns its 32 bytes (byte 16 (8 w + g) + r): plain byte stores;
- keys: the token's codes are bit pair r % 4 of 128 bytes it shares with 3 other tokens, 32
  words of 4 bytes (word 32 (r // 4) + 8 t + 2 s + hh, byte b). Each word is cleared and set
  with two relaxed atomics, AND ~(0x03030303 << 2 (r % 4)) then OR: exact whatever the page
  held before (no zeroing when a page is taken), and two writers of the other tokens of the
  word, in this launch or another program, touch other bits. Same-address atomics of one
  thread keep their order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fix_top(code, pair):
    """Bit pair 3 holds (c + 2) mod 4 (its own inverse)."""
    return tl.where(pair == 3, (code + 2) & 3, code)


@triton.jit
def load_code_bytes(c_ptr, rows, rmask, IS_KEY: tl.constexpr, MASKED: tl.constexpr, WP: tl.constexpr):
    """Planar code bytes [R, WP] uint8 of flat pool rows ``rows`` [R] (masked by rmask: 0)."""
    j = tl.arange(0, WP)[None, :]
    if not MASKED:
        return tl.load(c_ptr + rows[:, None] * WP + j, mask=rmask[:, None], other=0)
    r = (rows % 16)[:, None]
    base = (rows[:, None] - r) * 32  # the block's first byte
    out = tl.zeros([rows.shape[0], WP], tl.int32)
    for pl in tl.static_range(4):  # plane pl: channels 32 pl + j
        if IS_KEY:  # channel 32 s + 16 hh + 4 t + b, s = pl: byte 128 (r // 4) + 32 t + 8 s + 4 hh + b
            off = 128 * (r // 4) + 32 * ((j // 4) % 4) + 8 * pl + 4 * (j // 16) + j % 4
            pair = r % 4
        else:  # channel 16 w + g + 8 j0 + 64 j1: byte 16 (8 w + g) + r, bit pair j0 + 2 j1
            w = 2 * (pl % 2) + j // 16
            off = 16 * (8 * w + j % 8) + r
            pair = (j // 8) % 2 + 2 * (pl // 2)
        b = tl.load(c_ptr + base + off, mask=rmask[:, None], other=0).to(tl.int32)
        out = out | (_fix_top((b >> (2 * pair)) & 3, pair) << (2 * pl))
    return out.to(tl.uint8)


@triton.jit
def store_value_codes(c_ptr, rows, rmask, code, R: tl.constexpr):
    """Value codes [R, 128] int32 of flat rows ``rows`` into their masked blocks (plain stores)."""
    r = rows % 16
    base = (rows - r) * 32
    c5 = tl.reshape(code, (R, 2, 4, 2, 8))  # c = 64 j1 + 16 w + 8 j0 + g
    j1 = tl.arange(0, 2)[None, :, None, None, None]
    j0 = tl.arange(0, 2)[None, None, None, :, None]
    pair = j0 + 2 * j1
    bits = _fix_top(c5, pair) << (2 * pair)
    byte = tl.sum(tl.sum(bits, axis=3), axis=1)  # [R, 4 w, 8 g]: disjoint bit pairs, sum == or
    byte = tl.reshape(byte, (R, 32))  # index 8 w + g
    idx = tl.arange(0, 32)[None, :]
    tl.store(c_ptr + base[:, None] + 16 * idx + r[:, None], byte.to(tl.uint8), mask=rmask[:, None])


@triton.jit
def store_key_codes(c32_ptr, rows, rmask, code, R: tl.constexpr):
    """Key codes [R, 128] int32 of flat rows ``rows`` into their masked blocks: per 32-bit word
    (``c32_ptr``: the pool as int32), AND the row's bit pairs clear, then OR them in."""
    r = (rows % 16).to(tl.int32)
    pair = (r % 4)[:, None, None, None, None]
    c5 = tl.reshape(code, (R, 4, 2, 4, 4))  # c = 32 s + 16 hh + 4 t + b
    b = tl.arange(0, 4)[None, None, None, None, :]
    word = tl.sum((_fix_top(c5, pair) << (2 * pair)) << (8 * b), axis=4)  # [R, 4 s, 2 hh, 4 t]
    word = tl.reshape(word, (R, 32))  # index 8 s + 4 hh + t
    idx = tl.arange(0, 32)[None, :]
    w_off = 32 * (r // 4)[:, None] + 8 * (idx % 4) + 2 * (idx // 8) + (idx // 4) % 2
    ptr = c32_ptr + ((rows - r) * 8)[:, None] + w_off  # 8 words per row of 32 bytes
    keep = ~(0x03030303 << (2 * (r % 4)))
    m = rmask[:, None]
    tl.atomic_and(ptr, tl.broadcast_to(keep[:, None], ptr.shape), mask=m, sem="relaxed")
    tl.atomic_or(ptr, word, mask=m, sem="relaxed")
