"""Rejected prototype (session 7, run 1): the clip threshold's order statistics two bits a round.

Drop-in for ``_order_stats`` in kernels/quant_triton.py at b64e927 (everything else unchanged).
On the H200 it saved 0.1-0.2 µs of a 2.8-3.6 µs decode-step write, cost 14 % of the prefill
write's throughput, and failed two clip tests on CUDA (fp16 / fp32 rows, D = 64, rho = 0.01)
that pass under the interpreter; not kept, the cause not pursued.
"""
import triton
import triton.language as tl


@triton.jit
def _count_below(bits, c1, c2, c3, lo_idx):
    """How many of the candidates c1 < c2 < c3 (t with the next two bits 01, 10, 11) leave at
    most lo values of each row below them: those two bits of the order statistic. The three row
    counts share one integer sum (a field each), so a round costs one reduction, as a one-bit
    round does."""
    below = ((bits < c1[:, None]).to(tl.int32)
             + ((bits < c2[:, None]).to(tl.int32) << 10)
             + ((bits < c3[:, None]).to(tl.int32) << 20))  # 10-bit fields: rows of <= 1023 values
    n = tl.sum(below, axis=1)
    return ((n & 1023) <= lo_idx).to(tl.int32) + (((n >> 10) & 1023) <= lo_idx).to(tl.int32) \
        + ((n >> 20) <= lo_idx).to(tl.int32)


@triton.jit
def _order_stats(a, lo_idx, hi_idx, LOW: tl.constexpr):
    """The lo-th and hi-th (lo or lo + 1) smallest of each row of a: [R, D] float32 >= 0
    (D <= 1023) whose LOW lowest bits are zero (zero_low_bits).

    Non-negative floats order like their bit patterns, so the lo-th smallest is the largest
    pattern t with #{a < t} <= lo, built from the top, two bits a round (_count_below): 8 rounds
    of compares and one row sum for bfloat16 values (bits 30..16), where a sort runs a network of
    compare-exchanges over the row (28 stages for D = 128). The hi-th smallest is t again if
    more than hi values are <= t, else the smallest value above t. Exact: the same numbers a sort
    picks, ties and zeros included. (H200, bisection against the sort: prefill writes 77M
    tokens/s instead of 58M; a decode step's write, a chain of dependent loads, no faster.)
    """
    bits = a.to(tl.int32, bitcast=True)
    t = tl.zeros([a.shape[0]], tl.int32)
    PAIRS: tl.constexpr = (31 - LOW) // 2
    for i in tl.static_range(PAIRS):
        digit = _count_below(bits, t | (1 << (29 - 2 * i)), t | (2 << (29 - 2 * i)),
                             t | (3 << (29 - 2 * i)), lo_idx)
        t = t | (digit << (29 - 2 * i))
    if (31 - LOW) % 2 == 1:  # the lowest bit alone
        below = tl.sum((bits < (t | (1 << LOW))[:, None]).to(tl.int32), axis=1)
        t = tl.where(below <= lo_idx, t | (1 << LOW), t)
    n_le = tl.sum((bits <= t[:, None]).to(tl.int32), axis=1)
    above = tl.min(tl.where(bits > t[:, None], bits, 0x7F800000), axis=1)  # +inf if none
    hi_bits = tl.where(n_le > hi_idx, t, above)
    return t.to(tl.float32, bitcast=True), hi_bits.to(tl.float32, bitcast=True)
