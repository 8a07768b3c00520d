"""Key / value tiles of decode-consistent prefill, read from where the cache keeps them.

Each loader returns a [BN, D] tile in the dots' operand dtype for positions ``pos`` [BN] of one
sequence and KV head, zeros where not ``ok``: the sink from its BF16 window pages, the stored
history from its INT-b pages (dequantized here, ``s * (code - z)`` in float32, the expression the
band pre-pass uses, then rounded once to the operand dtype), the band from the pre-pass buffers.
The portable path gathers one code byte per (token, channel) (the planar byte order or the masked
INT2 blocks of ``code_layout_ref``), so any position and any page boundary reads the same way.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def window_tile(win_ptr, wt_row, pos, ok, h, H_KV: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                DOT_DT: tl.constexpr):  # fmt: skip
    """Sink positions (window slot = position) from the window pages."""
    page = tl.load(wt_row + pos // P, mask=ok, other=0)
    rows = (page.to(tl.int64) * H_KV + h) * P + pos % P
    d = tl.arange(0, D)[None, :]
    return tl.load(win_ptr + rows[:, None] * D + d, mask=ok[:, None], other=0.0).to(DOT_DT)


@triton.jit
def history_rows(qt_row, pos, ok, h, SINK: tl.constexpr, H_KV: tl.constexpr, P: tl.constexpr):
    """(history row index [BN], flat pool rows [BN]) of stored history positions (row pos - S0)."""
    hidx = tl.where(ok, pos - SINK, 0)
    page = tl.load(qt_row + hidx // P, mask=ok, other=0)
    return hidx, (page.to(tl.int64) * H_KV + h) * P + hidx % P


@triton.jit
def code_tile(c_ptr, hidx, rows, ok, D: tl.constexpr, BITS: tl.constexpr, MASKED: tl.constexpr,
              IS_KEY: tl.constexpr):  # fmt: skip
    """Codes [BN, D] int32 (0 .. 2^BITS - 1) of flat pool rows ``rows``: one byte gathered per
    (token, channel), in the planar order or from the masked INT2 blocks."""
    c = tl.arange(0, D)[None, :]
    if MASKED:  # INT2 at head_dim 128: 16-token blocks of 512 bytes (code_layout_ref)
        r = (hidx % 16)[:, None]
        block = (rows[:, None] - r) * 32
        if IS_KEY:
            byte = 128 * (r // 4) + (32 * ((c // 4) % 4) + 8 * (c // 32) + 4 * ((c // 16) % 2) + c % 4)
            pair = r % 4
        else:
            byte = r + 16 * (8 * ((c % 64) // 16) + c % 8)
            pair = (c // 8) % 2 + 2 * (c // 64)
        raw = tl.load(c_ptr + block + byte, mask=ok[:, None], other=0).to(tl.int32)
        code = (raw >> (2 * pair)) & 3
        code = code ^ tl.where(pair == 3, 2, 0)  # bit pair 3 stores (c + 2) mod 4
    else:  # planar: byte j holds channels j + i WP at bits BITS i
        WP: tl.constexpr = D * BITS // 8
        raw = tl.load(c_ptr + rows[:, None] * WP + c % WP, mask=ok[:, None], other=0).to(tl.int32)
        code = (raw >> (BITS * (c // WP))) & ((1 << BITS) - 1)
    return code


@triton.jit
def code_values(code, BITS: tl.constexpr, DOT_DT: tl.constexpr):
    """Codes as values of the dots' dtype, exact. INT2 into bfloat16 by bit pattern (a select, a
    shift and a mask; no int-to-float conversion, PERF_NOTES): 0, 1, 2, 3 are 0x0000, 0x3F80,
    0x4000, 0x4040. No offset such as 0x4300 | c (= 128 + c): the value dot would then carry
    128 sum(p s) beside a signal near zero, and on an H100 the result lost all its digits
    (bench/results/2026-12-05-h100-decode-consistent-prefill-kernel)."""
    if DOT_DT == tl.bfloat16 and BITS == 2:
        word = tl.where(code >= 2, 0x40404000, 0x3F800000)
        out = ((word >> ((code & 1) * 16)) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        out = code.to(tl.float32).to(DOT_DT)
    return out


@triton.jit
def history_tile(c_ptr, s_ptr, z_ptr, qt_row, pos, ok, h, SINK: tl.constexpr, H_KV: tl.constexpr,
                 P: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 MASKED: tl.constexpr, IS_KEY: tl.constexpr, DOT_DT: tl.constexpr):  # fmt: skip
    """Stored history positions (history row pos - S0) from the INT-b (or 16-bit) pages,
    dequantized: s * (code - z) in float32, rounded once to the dots' dtype."""
    hidx, rows = history_rows(qt_row, pos, ok, h, SINK, H_KV, P)
    c = tl.arange(0, D)[None, :]
    if BITS == 16:
        x = tl.load(c_ptr + rows[:, None] * D + c, mask=ok[:, None], other=0.0).to(tl.float32)
    else:
        code = code_tile(c_ptr, hidx, rows, ok, D, BITS, MASKED, IS_KEY)
        NG: tl.constexpr = D // GROUP
        grp = rows[:, None] * NG + c // GROUP
        sc = tl.load(s_ptr + grp, mask=ok[:, None], other=0.0).to(tl.float32)
        ze = tl.load(z_ptr + grp, mask=ok[:, None], other=0.0).to(tl.float32)
        x = sc * (code.to(tl.float32) - ze)
    return x.to(DOT_DT)


@triton.jit
def band_tile(band_ptr, row0, pos, ok, h, H_KV: tl.constexpr, D: tl.constexpr):
    """Band positions from a pre-pass buffer [N + B W, H_kv, D] (row row0 + pos holds pos)."""
    rows = (row0 + pos).to(tl.int64) * H_KV + h
    d = tl.arange(0, D)[None, :]
    return tl.load(band_ptr + rows[:, None] * D + d, mask=ok[:, None], other=0.0)
