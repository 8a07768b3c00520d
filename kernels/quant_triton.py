"""The reference quantizer (``oscar_compile.quant``) as Triton device functions, bit-exact.

Exactness is the point: codes, scales and zeros written by a kernel must equal what
``quant.quantize`` produces. Every step therefore uses the same IEEE operation torch does, one
rounding per torch op:
- clip threshold: ascending ``tl.sort`` of |x| along D, order statistics at the indices
  ``lo = int(rho * (D - 1))`` and ``hi = min(lo + 1, D - 1)`` picked by the wrapper in Python
  (double precision, as quant.py does), then ``lo_v + frac * (hi_v - lo_v)`` with frac rounded to
  float32, a separate multiply and add (the kernel is compiled with ``enable_fp_fusion=False``,
  so no FMA contraction changes the rounding);
- ``s = max((max - min) / qmax, max(|min|, |max|) * 2^-10)`` and ``z = -min / s`` with correctly rounded division (``div_rn``;
  Triton's default float division is approximate), s = 1 where max == min;
- scale/zero rounded to the scale dtype (round to nearest even), codes computed from the rounded
  values: ``rint(div_rn(x, s) + z)`` (round half to even, like ``torch.round``, by the 1.5 * 2^23 trick), clamped.
- planar packing: byte j of a row holds code j + i * D / n at bit offset b * i.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels then pick interpreter-friendly variants)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def clip_indices(clip_ratio: float, head_dim: int) -> tuple[int, int, float]:
    """(lo, hi, frac) of the rho-quantile exactly as ``quant.clip_threshold`` computes them."""
    pos = clip_ratio * (head_dim - 1)
    lo = int(pos)
    return lo, min(lo + 1, head_dim - 1), pos - lo


@triton.jit
def _order_stats_by_rank(a, lo_idx, hi_idx, D: tl.constexpr):
    """The lo-th and hi-th smallest of each row of a: [R, D] via stable ranks (interpreter path).

    rank_c = #{j: a_j < a_c} + #{j < c: a_j == a_c} is a permutation of 0..D-1, so each index is
    picked exactly once: the same numbers a sort gives. O(D^2) work, vectorised, which numpy
    runs far faster than the interpreter runs ``tl.sort``'s network.
    """
    col = tl.arange(0, D)
    ai = a[:, :, None]  # [R, D(c), 1]
    aj = a[:, None, :]  # [R, 1, D(j)]
    before = (aj < ai) | ((aj == ai) & (col[None, None, :] < col[None, :, None]))
    rank = tl.sum(before.to(tl.int32), axis=2)  # [R, D]
    lo_v = tl.sum(tl.where(rank == lo_idx, a, 0.0), axis=1)
    hi_v = tl.sum(tl.where(rank == hi_idx, a, 0.0), axis=1)
    return lo_v, hi_v


@triton.jit
def clip_rows(x, lo_idx, hi_idx, frac, D: tl.constexpr, BY_RANK: tl.constexpr):
    """Clamp each row of x: [R, D] float32 to [-tau, tau], tau = the rho-quantile of |x|.

    BY_RANK (interpreter): order statistics by rank counting instead of ``tl.sort``.
    """
    a = tl.abs(x)
    if BY_RANK:
        lo_v, hi_v = _order_stats_by_rank(a, lo_idx, hi_idx, D)
    else:
        srt = tl.sort(a, dim=1)
        col = tl.arange(0, D)[None, :]
        # exactly one non-zero term per row: the sums are exact picks
        lo_v = tl.sum(tl.where(col == lo_idx, srt, 0.0), axis=1)
        hi_v = tl.sum(tl.where(col == hi_idx, srt, 0.0), axis=1)
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
    NG: tl.constexpr = D // GROUP
    NPL: tl.constexpr = 8 // BITS  # codes per byte = planes
    WP: tl.constexpr = D // NPL  # bytes per row
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
    planes = tl.reshape(code, (R, NPL, WP))
    shift = (tl.arange(0, NPL) * BITS)[None, :, None]
    packed = tl.sum(planes << shift, axis=1)  # disjoint bits: the sum is an OR
    return packed.to(tl.uint8), scale, zero
