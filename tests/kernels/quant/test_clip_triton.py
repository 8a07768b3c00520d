"""The clip threshold's selection in Triton (bisection on bit patterns) against
``quant.clip_per_token``: bitwise, ties and zeros included, for values of each window dtype."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from oscar_compile import quant
from oscar_compile.kernels.quant.quant_triton import clip_indices, clip_rows, zero_low_bits


@triton.jit
def _clip_kernel(x_ptr, out_ptr, lo, hi, frac, R: tl.constexpr, D: tl.constexpr,
                 LOW: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, clip_rows(x, lo, hi, frac, LOW))


def _rows(D: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(D)
    x = torch.randn(8, D, generator=gen)
    x[1, : D // 2] = x[1, D // 2:]  # every |value| twice
    x[2] = x[2].round()  # few distinct values, zeros among them
    x[3, D // 4:] = 0.0
    x[4] = x[4] * 1e-6  # float16 subnormals
    x[5] = x[5] * 3e3  # large exponents (float16 still finite)
    x[6] = -x[6].abs()  # all negative
    x[7] = 1.5  # all equal
    return x.to(dtype).float()


@pytest.mark.parametrize("D,rho", [(64, 0.96), (128, 0.92), (128, 0.5), (32, 0.99), (64, 1 / 63), (64, 0.01)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_clip_rows_match_quant(tdevice, D, rho, dtype):
    x = _rows(D, dtype).to(tdevice)
    lo, hi, frac = clip_indices(rho, D)
    out = torch.empty_like(x)
    _clip_kernel[(1,)](x, out, lo, hi, frac, R=x.shape[0], D=D, LOW=zero_low_bits(dtype))
    assert torch.equal(out.cpu(), quant.clip_per_token(x.cpu(), rho))


def test_clip_rows_top_index(tdevice):
    """lo = hi = D - 1 (no value above the lo-th): tau is the row's largest |x|, nothing clips."""
    D = 64
    x = _rows(D, torch.bfloat16).to(tdevice)
    out = torch.empty_like(x)
    _clip_kernel[(1,)](x, out, D - 1, D - 1, 0.5, R=x.shape[0], D=D, LOW=16)
    assert torch.equal(out, x)
