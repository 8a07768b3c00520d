"""The reference quantizer (``oscar_compile.quant``) as Triton device functions, bit-exact.

Exactness is the point: codes, scales and zeros written by a kernel must equal what
``quant.quantize`` produces. Every step therefore uses the same IEEE operation torch does, one
rounding per torch op:
- clip threshold: the order statistics of |x| along D at the indices
  ``lo = int(rho * (D - 1))`` and ``hi = min(lo + 1, D - 1)`` (picked by the wrapper in Python,
  double precision, as quant.py does; selected by bisection on the bit patterns), then
  ``lo_v + frac * (hi_v - lo_v)`` with frac rounded to float32, a separate multiply and add (the
  kernel is compiled with ``enable_fp_fusion=False``, so no FMA contraction changes the rounding);
- ``s = max((max - min) / qmax, max(|min|, |max|) * 2^-10)`` and ``z = -min / s`` with correctly
  rounded division (``div_rn``; Triton's default float division is approximate), s = 1 where max == min;
- scale/zero rounded to the scale dtype (round to nearest even), codes computed from the rounded
  values: ``rint(div_rn(x, s) + z)`` (round half to even, like ``torch.round``, by the 1.5 * 2^23 trick), clamped.
- planar packing: byte j of a row holds code j + i * D / n at bit offset b * i (``quantize_rows``;
  ``quantize_codes`` leaves the codes unpacked for the masked INT2 pages, ``code_layout_triton``).
"""
from __future__ import annotations

import triton
import triton.language as tl


def clip_indices(clip_ratio: float, head_dim: int) -> tuple[int, int, float]:
    """(lo, hi, frac) of the rho-quantile exactly as ``quant.clip_threshold`` computes them."""
    pos = clip_ratio * (head_dim - 1)
    lo = int(pos)
    return lo, min(lo + 1, head_dim - 1), pos - lo


def zero_low_bits(dtype) -> int:
    """How many low bits of a float32 are zero when it holds a value of ``dtype``: a bfloat16
    widens into the top 16 bits, a float16 (subnormals included) into at most the top 19; 0 (no
    assumption: exact for any float32, only more rounds) for every other dtype."""
    import torch

    return {torch.bfloat16: 16, torch.float16: 13}.get(dtype, 0)


@triton.jit
def _order_stats(a, lo_idx, hi_idx, LOW: tl.constexpr):
    """The lo-th and hi-th (lo or lo + 1) smallest of each row of a: [R, D] float32 >= 0 whose
    LOW lowest bits are zero (zero_low_bits).

    Non-negative floats order like their bit patterns, so the lo-th smallest is the largest
    pattern t with #{a < t} <= lo, built bit by bit from the top: 31 - LOW rounds of a compare
    and a row count (15 for bfloat16 values), where a sort runs a network of compare-exchanges
    over the row (28 stages for D = 128). The hi-th smallest is t again if more than hi values
    are <= t, else the smallest value above t. Exact: the same numbers a sort picks, ties and
    zeros included. (H200, against the sort: prefill writes 77M tokens/s instead of 58M; a
    decode step's write, a chain of dependent loads, no faster.)
    """
    bits = a.to(tl.int32, bitcast=True)
    t = tl.zeros([a.shape[0]], tl.int32)
    for i in tl.static_range(31 - LOW):
        cand = t | (1 << (30 - i))
        below = tl.sum((bits < cand[:, None]).to(tl.int32), axis=1)
        t = tl.where(below <= lo_idx, cand, t)
    n_le = tl.sum((bits <= t[:, None]).to(tl.int32), axis=1)
    above = tl.min(tl.where(bits > t[:, None], bits, 0x7F800000), axis=1)  # +inf if none
    hi_bits = tl.where(n_le > hi_idx, t, above)
    return t.to(tl.float32, bitcast=True), hi_bits.to(tl.float32, bitcast=True)


@triton.jit
def clip_rows(x, lo_idx, hi_idx, frac, LOW: tl.constexpr):
    """Clamp each row of x: [R, D] float32 to [-tau, tau], tau = the rho-quantile of |x|; the
    values of x carry LOW zero low bits (zero_low_bits of the dtype they came from)."""
    lo_v, hi_v = _order_stats(tl.abs(x), lo_idx, hi_idx, LOW)
    tau = (lo_v + frac * (hi_v - lo_v))[:, None]
    return tl.minimum(tl.maximum(x, -tau), tau)


@triton.jit
def to_bf16_rne(x):
    """float32 -> bfloat16, round to nearest even, spelled out in integer ops (finite x).

    The GPU conversion already rounds this way; the interpreter's truncates, so the rounding is
    done here explicitly and the final cast only drops zero bits.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    return ((bits >> 16) << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def round_half_even(y):
    """rint for |y| < 2^22 in float32: adding and removing 1.5 * 2^23 rounds to nearest even.

    Used instead of libdevice.rint because it also runs under TRITON_INTERPRET (numpy float32);
    the kernel is compiled without fp fusion and Triton does not reassociate float adds.
    """
    MAGIC: tl.constexpr = 12582912.0
    return (y + MAGIC) - MAGIC


@triton.jit
def quantize_rows(x, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                  SCALE_DT: tl.constexpr):
    """x: [R, D] float32 (already clipped) -> packed [R, D*BITS/8] uint8, scale, zero [R, D/GROUP]."""
    NPL: tl.constexpr = 8 // BITS  # codes per byte = planes
    WP: tl.constexpr = D // NPL  # bytes per row
    code, scale, zero = quantize_codes(x, R, D, BITS, GROUP, SCALE_DT)
    planes = tl.reshape(code, (R, NPL, WP))
    shift = (tl.arange(0, NPL) * BITS)[None, :, None]
    packed = tl.sum(planes << shift, axis=1)  # disjoint bits: the sum is an OR
    return packed.to(tl.uint8), scale, zero


@triton.jit
def quantize_codes(x, R: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                   SCALE_DT: tl.constexpr):
    """x: [R, D] float32 (already clipped) -> codes [R, D] int32 (unpacked), scale, zero [R, D/GROUP]."""
    NG: tl.constexpr = D // GROUP
    QMAX: tl.constexpr = (1 << BITS) - 1
    xg = tl.reshape(x, (R, NG, GROUP))
    mn = tl.min(xg, axis=2)
    mx = tl.max(xg, axis=2)
    s = tl.math.div_rn(mx - mn, tl.full(mn.shape, QMAX, tl.float32))
    s = tl.maximum(s, tl.maximum(tl.abs(mn), tl.abs(mx)) * 0.0009765625)  # quant.ZERO_POINT_FLOOR = 2^-10 (exact)
    s = tl.where(s == 0.0, 1.0, s)
    z = tl.math.div_rn(-mn, s)
    if SCALE_DT == tl.bfloat16:
        scale = to_bf16_rne(s)
        zero = to_bf16_rne(z)
    else:
        scale = s.to(SCALE_DT)
        zero = z.to(SCALE_DT)
    s32 = scale.to(tl.float32)[:, :, None]
    z32 = zero.to(tl.float32)[:, :, None]
    y = tl.math.div_rn(xg, tl.broadcast_to(s32, xg.shape)) + z32
    code = tl.minimum(tl.maximum(round_half_even(y), 0.0), QMAX * 1.0).to(tl.int32)
    return tl.reshape(code, (R, D)), scale, zero
