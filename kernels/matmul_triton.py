"""Triton batch-invariant ``x @ w.T + b``: a persistent matmul with one fixed tiling per weight shape.

Why: cuBLAS chooses its kernel, its tiles and its split-K from the shape, so a request's logits
change in their last bits with the batch it shares (Thinking Machines, "Defeating
Nondeterminism in LLM Inference", 2025). Here every call, whatever the number of rows, runs the
same compiled kernel: fixed ``BLOCK_M x BLOCK_N`` output tiles, each reduced over K in
``BLOCK_K`` steps from the start of its K range, with no autotuning. An output element is the
same sequence of MMA accumulations in every batch; only which program computes its tile, and
when, changes (the grid is ``min(work items, SMs)`` programs walking them).

Split-K from the weight's shape only. A one-row step has only N / BLOCK_N tiles (64 for a
4096-wide output, 16 for 1024), too few programs to stream the weight at the HBM rate. So a
narrow layer's K is cut into ``split_k(N, K)`` equal ranges, each reduced by its own program into
a float32 partial, and the partials are added in split order 0, 1, ... by a second kernel, which
also adds the bias and rounds once. The split count depends on N and K, never on M or the GPU,
so an element's arithmetic is still the same in every batch. Its price grows with M: the
partials' traffic is ``2 * 4 * M * N * splits`` bytes, paid by prefill (``bench.serve`` TTFT).

float32 inputs multiply in IEEE float32 (no TF32), as torch does by default. Reference:
``matmul_ref.linear_ref``; tests: tests/kernels/test_batch_invariance.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.kernels.device import num_sms

BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3
# split-K: up to this many (N tile, K range) items for one row (about one per SM of an H100 /
# H200, but a constant: the split must not depend on the GPU), ranges of at least MIN_SPLIT_K
SPLIT_TARGET = 128
MIN_SPLIT_K = 512


def split_k(N: int, K: int) -> int:
    """How many K ranges a [N, K] weight's reduction is cut into: a power of two, from its shape only."""
    tiles_n = triton.cdiv(N, BLOCK_N)
    splits = 1
    while tiles_n * splits * 2 <= SPLIT_TARGET and K % (splits * 2 * BLOCK_K) == 0 and K // (splits * 2) >= MIN_SPLIT_K:
        splits *= 2
    return splits


# M and the grid are not specialized: one compiled kernel for every number of rows (Triton would
# otherwise build a separate variant for M = 1 and for multiples of 16)
@triton.jit(do_not_specialize=["M", "num_programs"])
def _persistent_matmul_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_cm,
    num_programs,
    SPLITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[N, K]^T (+ bias[N]); program p takes work items p, p + num_programs, ...
    An item is (M tile, N tile, K range); with SPLITS > 1, C is the float32 partials [SPLITS, M, N]
    (no bias: ``_sum_splits_kernel`` adds it)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_items = tl.cdiv(M, BLOCK_M) * tiles_n * SPLITS
    k_range = K // SPLITS
    for item in range(pid, num_items, num_programs):
        tile = item // SPLITS
        split = item % SPLITS
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
        b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_start = split * k_range
        for k0 in range(k_start, k_start + k_range, BLOCK_K):
            k = k0 + rk
            a = tl.load(a_rows + k[None, :] * stride_ak, mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            b = tl.load(b_cols + k[:, None] * stride_bk, mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS and SPLITS == 1:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + split.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["MN"])
def _sum_splits_kernel(part_ptr, bias_ptr, c_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """C = ((partial 0 + partial 1) + ...) (+ bias), rounded once: the same order for every element."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K], bias: [N] or None -> [..., N] in x.dtype (float32 accumulation)."""
    K = x.shape[-1]
    N = weight.shape[0]
    if weight.shape[1] != K or weight.dtype != x.dtype or (bias is not None and bias.shape != (N,)):
        raise ValueError(
            f"linear_triton: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}, bias {None if bias is None else tuple(bias.shape)}"
        )
    a = x.reshape(-1, K)
    M = a.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.reshape(*x.shape[:-1], N)
    splits = split_k(N, K)
    target = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    num_items = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N) * splits
    programs = min(num_items, num_sms(x.device))
    _persistent_matmul_kernel[(programs,)](
        a,
        weight,
        bias if bias is not None else out,
        target,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        programs,
        SPLITS=splits,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(M * N, block),)](
            target, bias if bias is not None else out, out, M * N, N, SPLITS=splits, HAS_BIAS=bias is not None,
            BLOCK=block
        )
    return out.reshape(*x.shape[:-1], N)
