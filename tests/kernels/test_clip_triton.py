"""The clip threshold's three selections in Triton (rank counting, full sort, top-k) against
``quant.clip_per_token``: bitwise, ties and zeros included."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from oscar_compile import quant
from oscar_compile.kernels.quant_triton import clip_indices, clip_rows, top_needed


@triton.jit
def _clip_kernel(x_ptr, out_ptr, lo, hi, frac, R: tl.constexpr, D: tl.constexpr,
                 BY_RANK: tl.constexpr, TOP: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, clip_rows(x, lo, hi, frac, D, BY_RANK, TOP))


def test_top_needed():
    assert top_needed(121, 128) == 8 and top_needed(116, 128) == 16  # rho 0.96 / 0.92, D = 128
    assert top_needed(60, 128) == 128  # past half the row: a full sort
    assert top_needed(63, 64) == 1


@pytest.mark.parametrize("D,rho", [(64, 0.96), (128, 0.92), (128, 0.5), (32, 0.99)])
@pytest.mark.parametrize("mode", ["rank", "sort", "topk"])
def test_clip_rows_selections_match_quant(tdevice, D, rho, mode):
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(4, D, generator=gen)
    x[1, : D // 2] = x[1, D // 2:]  # every |value| twice
    x[2] = x[2].round()  # few distinct values, zeros among them
    x[3, D // 4:] = 0.0
    x = x.to(tdevice)
    lo, hi, frac = clip_indices(rho, D)
    out = torch.empty_like(x)
    top = top_needed(lo, D) if mode == "topk" else D
    _clip_kernel[(1,)](x, out, lo, hi, frac, R=4, D=D, BY_RANK=mode == "rank", TOP=top)
    assert torch.equal(out.cpu(), quant.clip_per_token(x.cpu(), rho))
