"""The clip threshold's two selections in Triton (rank counting for the interpreter, the full
sort the GPU runs) against ``quant.clip_per_token``: bitwise, ties and zeros included."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from oscar_compile import quant
from oscar_compile.kernels.quant_triton import clip_indices, clip_rows


@triton.jit
def _clip_kernel(x_ptr, out_ptr, lo, hi, frac, R: tl.constexpr, D: tl.constexpr,
                 BY_RANK: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, clip_rows(x, lo, hi, frac, D, BY_RANK))


@pytest.mark.parametrize("D,rho", [(64, 0.96), (128, 0.92), (128, 0.5), (32, 0.99)])
@pytest.mark.parametrize("by_rank", [True, False])
def test_clip_rows_selections_match_quant(tdevice, D, rho, by_rank):
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(4, D, generator=gen)
    x[1, : D // 2] = x[1, D // 2:]  # every |value| twice
    x[2] = x[2].round()  # few distinct values, zeros among them
    x[3, D // 4:] = 0.0
    x = x.to(tdevice)
    lo, hi, frac = clip_indices(rho, D)
    out = torch.empty_like(x)
    _clip_kernel[(1,)](x, out, lo, hi, frac, R=4, D=D, BY_RANK=by_rank)
    assert torch.equal(out.cpu(), quant.clip_per_token(x.cpu(), rho))
