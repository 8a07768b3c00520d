"""The masked INT2 page layout (``code_layout_ref``) in Triton: block reads, planar gathers, per-token writes.

Flat pool row ``row`` = (page * H_kv + head) * P + row in page; its block starts at row
``row - row % 16``. Two ways to read a masked page (INT2, head_dim 128, pages of a multiple of
16 tokens, ``formats.cache.code_layout``):
- the attention kernel's history tiles (16-token aligned runs of tokens) read whole blocks as
  contiguous runs (:func:`masked_block_rows`, :func:`load_masked_key_plane`,
  :func:`load_masked_value_bytes`): 8-byte key and 16-byte value loads, every byte once, and
  decode them in the stored order (a key bit pair is one token of a quad, joined back into
  token order by :func:`join_key_pairs`; a value bit pair j is the channels
  :func:`value_columns` names, accumulated in that order and written back once);
- :func:`load_code_bytes` gathers any rows' codes into the planar bytes the rows would have
  held (plane i of a row's 32 bytes holds channels [32 i, 32 i + 32)), with per-word and
  per-byte loads: the extend path's dequantization, and the attention values when a
  quantization group is narrower than a masked value plane's channel set (G = 32).

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
def masked_block_rows(rows, BN: tl.constexpr):
    """First flat row [BN // 16] of each 16-token block of history tile rows ``rows`` [BN] (tokens
    n0 .. n0 + BN, n0 a multiple of 16, so the tile is whole blocks). Rows past the history read
    page 0; a block's first token is in the history if any of its tokens is (they are a
    prefix), so its row names the block's page."""
    r = tl.reshape(rows, (BN // 16, 16))
    return tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, r, 0), axis=1)


@triton.jit
def load_masked_key_plane(c_ptr, blk, S: tl.constexpr):
    """Key bytes [NB, 4 q, 4 t, 8 e] uint8 of plane S (channels 32 S + 16 hh + 4 t + b, e = 4 hh + b)
    of 16-token blocks starting at flat rows ``blk`` [NB]: byte 128 q + 32 t + 8 S + e, 8 bytes
    contiguous; bit pair j holds token 4 q + j (pair 3 as (c + 2) mod 4)."""
    q = tl.arange(0, 4)[None, :, None, None]
    t = tl.arange(0, 4)[None, None, :, None]
    e = tl.arange(0, 8)[None, None, None, :]
    return tl.load(c_ptr + blk[:, None, None, None] * 32 + 128 * q + 32 * t + 8 * S + e)


@triton.jit
def join_key_pairs(d0, d1, d2, d3):
    """Decoded bit pairs j = 0..3 of :func:`load_masked_key_plane` ([NB, 4 q, 4 t, 8 e] each)
    -> [16 NB, 32]: row 16 blk + 4 q + j (token order), column 16 hh + 4 t + b (planar order)."""
    NB: tl.constexpr = d0.shape[0]
    x = tl.join(tl.join(d0, d1), tl.join(d2, d3))  # [NB, q, t, e, j & 1, j >> 1]
    x = tl.reshape(x, (NB, 4, 4, 2, 4, 2, 2))  # [NB, q, t, hh, b, j & 1, j >> 1]
    x = tl.permute(x, (0, 1, 6, 5, 3, 2, 4))  # [NB, q, j >> 1, j & 1, hh, t, b]
    return tl.reshape(x, (NB * 16, 32))


@triton.jit
def load_masked_value_bytes(c_ptr, blk):
    """Value bytes [16 NB, 32] uint8 of the 16-token blocks starting at flat rows ``blk`` [NB]:
    row 16 blk + r, column 8 w + g = byte 16 (8 w + g) + r, read 16 tokens (bytes) at a time.
    Bit pair j of column i holds channel ``value_columns(j)[i]`` (pair 3 as (c + 2) mod 4)."""
    NB: tl.constexpr = blk.shape[0]
    i = tl.arange(0, 32)[None, :, None]
    r = tl.arange(0, 16)[None, None, :]
    b = tl.load(c_ptr + blk[:, None, None] * 32 + 16 * i + r)  # [NB, 32 i, 16 r]
    return tl.reshape(tl.permute(b, (0, 2, 1)), (NB * 16, 32))


@triton.jit
def value_columns(PL: tl.constexpr, WP: tl.constexpr, MASKED: tl.constexpr):
    """Channels [WP] of value accumulator plane PL: [PL WP, (PL + 1) WP) planar; masked (INT2 at
    head_dim 128), bit pair PL of the value bytes: channel 16 w + g + 8 (PL & 1) + 64 (PL >> 1)
    of column 8 w + g."""
    i = tl.arange(0, WP)
    if MASKED:
        c = 16 * (i // 8) + i % 8 + 8 * (PL % 2) + 64 * (PL // 2)
    else:
        c = PL * WP + i
    return c


@triton.jit
def load_code_bytes(c_ptr, rows, rmask, IS_KEY: tl.constexpr, MASKED: tl.constexpr, WP: tl.constexpr):
    """Planar code bytes [R, WP] uint8 of flat pool rows ``rows`` [R] (masked by rmask: 0)."""
    j = tl.arange(0, WP)[None, :]
    if not MASKED:
        return tl.load(c_ptr + rows[:, None] * WP + j, mask=rmask[:, None], other=0)
    R: tl.constexpr = rows.shape[0]
    r = (rows % 16)[:, None]
    ok = rmask[:, None]
    if IS_KEY:  # 32-bit words: word 32 (r // 4) + 8 t + 2 s + hh holds channels 32 s + 16 hh + 4 t + b in byte b
        k = tl.arange(0, WP // 4)[None, :]  # planar word k = 4 hh + t: planar bytes 4 k .. 4 k + 3 of plane s
        words = c_ptr.to(tl.pointer_type(tl.int32)) + (rows[:, None] - r) * 8 + 32 * (r // 4)
        shift = (2 * (r % 4)).to(tl.int32)
        top = tl.where(r % 4 == 3, 0x02020202, 0)  # pair 3: (c + 2) mod 4 is c ^ 2
        acc = tl.zeros([R, WP // 4], tl.int32)
        for pl in tl.static_range(4):
            wd = tl.load(words + 8 * (k % 4) + 2 * pl + k // 4, mask=ok, other=0)
            acc = acc | ((((wd >> shift) & 0x03030303) ^ top) << (2 * pl))
        b = tl.arange(0, 4)[None, None, :]
        out = tl.reshape((acc[:, :, None] >> (8 * b)) & 0xFF, (R, WP))
    else:  # channel 16 w + g + 8 j0 + 64 j1: byte 16 (8 w + g) + r, bit pair j0 + 2 j1; planes h and h + 2 share it
        base = (rows[:, None] - r) * 32  # the block's first byte
        j0 = (j // 8) % 2
        out = tl.zeros([R, WP], tl.int32)
        for half in tl.static_range(2):
            bt = tl.load(c_ptr + base + 16 * (8 * (2 * half + j // 16) + j % 8) + r, mask=ok, other=0).to(tl.int32)
            for j1 in tl.static_range(2):
                pair = j0 + 2 * j1
                out = out | (_fix_top((bt >> (2 * pair)) & 3, pair) << (2 * (half + 2 * j1)))
    out = tl.where(ok, out, 0)
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
