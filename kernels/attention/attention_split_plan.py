"""The launch plan of the Triton attention kernels in deterministic mode, and its fixed-order merge.

The default plans (``attention_triton.plan_launch``) size the history splits from the batch and
the SM count, and a mixed step runs its decode rows in prefill-shaped programs: a row's bits then
depend on the batch. In deterministic mode (``kernels.determinism.split_tokens()`` is set) every
launch of the INT-b and BF16 kernels takes one shape, whatever the batch:

- query blocks of ``prefill_rows // g`` tokens (64 query rows) for decode and prefill alike, so
  every row goes through the same dot shapes and the same kernel (no register cap either);
- the history split into parts of ``split_tokens`` keys from history position 0 (split s holds
  ``[s * split_tokens, (s + 1) * split_tokens)``), as many as the page table can hold (at least
  one): a split past a sequence's history is empty and its partial is an exact zero;
- one window program (sink, ring and the chunk's own keys), after the history splits;
- ``merge_partials_in_order``: the partials added one after another, in split order (the default
  merge sums a power-of-two tile in a tree whose shape follows the number of splits).

A new kernel (e.g. a Gluon decode kernel) honours the mode by the same rule: split s covers the
same absolute history tokens in every batch, and the merge adds the splits in order.
"""

from __future__ import annotations

import triton
import triton.language as tl


def deterministic_launch(max_hist: int, g: int, split_tokens: int, block_n: int, prefill_rows: int = 64):
    """(BLOCK_M, ROWS, NSPLIT) for every launch of deterministic mode (the window program is one)."""
    if split_tokens % block_n:
        raise ValueError(f"split_tokens {split_tokens} must be a multiple of the history block {block_n}")
    block_m = max(1, prefill_rows // g)
    rows = max(16, triton.next_power_of_2(block_m * g))
    return block_m, rows, max(1, triton.cdiv(max_hist, split_tokens))


@triton.jit(do_not_specialize=["NS"])
def _merge_in_order_kernel(po_ptr, pl_ptr, out_ptr, NS, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[r] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max), the sums taken s = 0, 1, ... in
    turn (the max is exact in any order); one program per (token, head) row and BLOCK_D columns."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    top = tl.load(pl_ptr + r * NS)
    for s in range(1, NS):
        top = tl.maximum(top, tl.load(pl_ptr + r * NS + s))
    num = tl.zeros([BLOCK_D], tl.float32)
    den = 0.0
    for s in range(0, NS):
        lse = tl.load(pl_ptr + r * NS + s)
        w = tl.where(lse == float("-inf"), 0.0, tl.math.exp2(lse - top))
        num += w * tl.load(po_ptr + (r * NS + s) * D + d)
        den += w
    tl.store(out_ptr + r * D + d, (num / den).to(out_ptr.dtype.element_ty))


def merge_partials_in_order(po, pl, out, num_partials: int, block_d: int = 32) -> None:
    """``attention_blocks_triton.merge_partials`` with the partials added in split order."""
    D = out.shape[-1]
    bd = min(block_d, D)
    _merge_in_order_kernel[(out.numel() // D, D // bd)](po, pl, out, num_partials, D=D, BLOCK_D=bd, num_warps=1)
