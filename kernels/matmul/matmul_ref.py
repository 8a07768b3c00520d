"""Batch-invariant ``x @ w.T + b`` without Triton: the CPU path of deterministic mode and the
reference of ``matmul_triton``.

Why: a BLAS picks its blocking, its kernel (GEMV for one row, GEMM for many) and its threading
from the matrix shapes, so row ``i`` of ``x @ w.T`` can change in its last bits when other rows
join the batch. Here every product has the one shape ``[ROW_TILE, K] @ [K, N]``: the rows are cut
into tiles of ``ROW_TILE`` (the last one zero-padded) and each tile goes through the same GEMM.
A row's result then depends on its own values only (the GEMM computes each output element from
its row and column alone, in an order set by the shape, which never changes). Bias is added after
the product, in the output dtype, as one more element-wise op.

``linear_ref`` is the plain product (no guarantee), the numerical oracle for both paths.
"""

from __future__ import annotations

import torch

ROW_TILE = 16


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K], weight: [N, K], bias: [N] or None -> [..., N]; float32 accumulation."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def linear_tiled(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int = ROW_TILE
) -> torch.Tensor:
    """x: [..., K], weight: [N, K] -> [..., N] in x.dtype, each row through one fixed GEMM shape."""
    K = x.shape[-1]
    rows = x.reshape(-1, K)
    M = rows.shape[0]
    padded = -(-M // row_tile) * row_tile
    if padded != M:
        rows = torch.cat([rows, rows.new_zeros(padded - M, K)])
    w_t = weight.T
    out = torch.cat([torch.mm(tile, w_t) for tile in rows.split(row_tile)])[:M]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
