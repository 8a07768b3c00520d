"""Triton batch-invariant ``x @ w.T + b``: a persistent matmul whose per-element arithmetic never changes.

Why: cuBLAS chooses its kernel, its tiles and its split-K from the shape, so a request's logits
change in their last bits with the batch it shares (Thinking Machines, "Defeating
Nondeterminism in LLM Inference", 2025). Here an output element is always the same chain of
tensor-core steps: its K products taken 16 at a time (one ``wgmma``/``mma`` k-step each) from
k = 0 up, accumulated in float32 in that order, by one program (no split-K), the bias added
last, rounded once. The output tile's size and the program that computes it do not enter that
chain, so the tile may follow the number of rows: ``TILES`` has a narrow tile for decode-sized
calls (a one-row step has N / 32 programs to stream the weight with, not N / 128) and a large one
for prefill (the vLLM batch-invariant matmul's 128 x 128 x 64, 8 warps). Both keep the k-step
order; ``BLOCK_K`` only sets how many k-steps one loop iteration issues. The GPU test checks
rows bitwise across the switch (tests/kernels/test_batch_invariance.py, marker ``gpu``).

Under ``TRITON_INTERPRET=1`` a dot is a NumPy matmul, whose summation order may follow the tile
shape, so the CPU test stays within one tile.

float32 inputs multiply in IEEE float32 (no TF32), as torch does by default. Reference:
``matmul_ref.linear_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.kernels.device import num_sms

# (most rows, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), the first that fits the call's rows
TILES = ((64, 64, 32, 128, 4, 4), (None, 128, 128, 64, 8, 3))


def tile_for(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a call of M rows."""
    return next(t[1:] for t in TILES if t[0] is None or M <= t[0])


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
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[N, K]^T (+ bias[N]); program p takes tiles p, p + num_programs, ..."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * tiles_n
    for tile in range(pid, num_tiles, num_programs):
        rm = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
        b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            a = tl.load(a_rows + k[None, :] * stride_ak, mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
            b = tl.load(b_cols + k[:, None] * stride_bk, mask=(k[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


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
    BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages = tile_for(M)
    num_tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    programs = min(num_tiles, num_sms(x.device))
    _persistent_matmul_kernel[(programs,)](
        a,
        weight,
        bias if bias is not None else out,
        out,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        programs,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out.reshape(*x.shape[:-1], N)
