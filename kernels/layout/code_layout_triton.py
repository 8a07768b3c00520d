"""The masked INT2 page layout (``code_layout_ref``) in Triton: reads of whole blocks, writes per token.

Flat pool row ``row`` = (page * H_kv + head) * P + row in page; its block starts at row
``row - row % 16``. Readers of a masked page (INT2, head_dim 128, pages of a multiple of 16
tokens, ``formats.cache.code_layout``) take runs of whole 16-token blocks (a history tile from a
multiple of 16, a page) and read each block's bytes once, in 8-byte (key) and 16-byte (value)
runs (:func:`masked_block_rows`, :func:`load_masked_key_plane`, :func:`load_masked_value_bytes`).
The attention kernel decodes them in the stored order, one AND per bit pair: a key bit pair is
one token of a quad (:func:`join_key_pairs` puts the tokens back in order), a value bit pair j
holds the channels :func:`value_columns` names (accumulated in that order, written back once).
Code that computes on planar rows (plane i of a row's 32 bytes: channels [32 i, 32 i + 32))
rebuilds them in registers (:func:`load_masked_planar_bytes`); planar pools are plain rows
(:func:`load_planar_bytes`).

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
def pair_code(b, J: tl.constexpr):
    """Codes int32 (0..3) of bit pair J of masked bytes b (pair 3 holds (c + 2) mod 4, c ^ 2)."""
    c = (b.to(tl.int32) >> (2 * J)) & 3
    if J == 3:
        c = c ^ 2
    return c


@triton.jit
def load_masked_planar_bytes(c_ptr, blk, IS_KEY: tl.constexpr):
    """The planar bytes [16 NB, 32] uint8 (byte j: channels j + 32 i at bits 2 i) of the token
    rows of the 16-token blocks at flat rows ``blk`` [NB], from the block reads above: for code
    that computes on planar rows (the extend path's dequantization; the attention values when a
    quantization group splits a bit pair's channels)."""
    NB: tl.constexpr = blk.shape[0]
    if IS_KEY:
        out = tl.zeros((NB * 16, 32), tl.int32)
        for s in tl.static_range(4):
            kp = load_masked_key_plane(c_ptr, blk, s)
            codes = join_key_pairs(pair_code(kp, 0), pair_code(kp, 1), pair_code(kp, 2), pair_code(kp, 3))
            out = out | (codes << (2 * s))
    else:
        # column 16 w1 + 8 w0 + g; planar byte 16 w0 + 8 j0 + g of plane s holds bit pair
        # j0 + 2 (s >> 1) of column 8 w0 + g of half w1 = s & 1
        vb = tl.reshape(load_masked_value_bytes(c_ptr, blk), (NB * 16, 2, 16))
        a, b = tl.split(tl.permute(vb, (0, 2, 1)))  # [16 NB, 16] each: w1 = 0, 1
        lo = pair_code(a, 0) | (pair_code(b, 0) << 2) | (pair_code(a, 2) << 4) | (pair_code(b, 2) << 6)
        hi = pair_code(a, 1) | (pair_code(b, 1) << 2) | (pair_code(a, 3) << 4) | (pair_code(b, 3) << 6)
        x = tl.reshape(tl.join(lo, hi), (NB * 16, 2, 8, 2))  # [16 NB, w0, g, j0]
        out = tl.reshape(tl.permute(x, (0, 1, 3, 2)), (NB * 16, 32))
    return out.to(tl.uint8)


@triton.jit
def load_planar_bytes(c_ptr, rows, rmask, WP: tl.constexpr):
    """Code bytes [R, WP] uint8 of planar flat pool rows ``rows`` [R] (masked by rmask: 0)."""
    return tl.load(c_ptr + rows[:, None] * WP + tl.arange(0, WP)[None, :], mask=rmask[:, None], other=0)


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
