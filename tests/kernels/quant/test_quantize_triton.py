"""``quant_triton.quantize_rows`` against ``quant.quantize`` (no clip): codes, scales and zeros
bitwise, on rows built to hit the rounding corners that random data almost never reaches."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from oscar_compile import quant
from oscar_compile.kernels.quant.quant_triton import quantize_rows

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, R: tl.constexpr, D: tl.constexpr,
                     BITS: tl.constexpr, GROUP: tl.constexpr, SCALE_DT: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * D + tl.arange(0, D)[None, :])
    packed, scale, zero = quantize_rows(x, R, D, BITS, GROUP, SCALE_DT)
    WP: tl.constexpr = D * BITS // 8
    NG: tl.constexpr = D // GROUP
    tl.store(codes_ptr + tl.arange(0, R)[:, None] * WP + tl.arange(0, WP)[None, :], packed)
    g = tl.arange(0, R)[:, None] * NG + tl.arange(0, NG)[None, :]
    tl.store(scale_ptr + g, scale)
    tl.store(zero_ptr + g, zero)


def _corner_rows() -> torch.Tensor:
    """16-value patterns (each row repeats its pattern, so 16-channel groups see it too)."""
    gen = torch.Generator().manual_seed(0)
    down = 1 + 2.0 ** -8  # halfway between bfloat16 1 and 1 + 2^-7: to even is down
    up = 1 + 3 * 2.0 ** -8  # halfway between 1 + 2^-7 and 1 + 2^-6: to even is up
    fill = torch.rand(10, generator=gen)
    rows = [
        # 2-bit: s = 1, z = 0, codes of x.5 ties (round half to even: 0, 2, 2)
        [0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, *(3 * fill[:9]).tolist()],
        # s = 1, z = 1: ties at -0.5, 0.5, 1.5
        [-1.0, 2.0, -0.5, 0.5, 1.5, 0.0, 1.0, *(3 * fill[:9] - 1).tolist()],
        # the 2-bit scale (hi - lo) / 3 = 1 + 3 * 2^-8: a bfloat16 scale ties (rounds up)
        [0.0, 3 * up, *(3 * fill).tolist(), 1.5, 0.75, 2.25, 3.0],
        # the zero -lo / s = 1 + 2^-8 with s = 1: a bfloat16 zero ties (rounds down)
        [-down, 3 - down, *(3 * fill - 1).tolist(), 0.0, 1.0, -0.5, 0.5],
        [0.7] * 16,  # constant: s from the zero-point floor
        [0.0] * 16,  # all zero: s = 1
        (torch.randn(16, generator=gen) * 1e-3).tolist(),
        (torch.randn(16, generator=gen) * 40).tolist(),
    ]
    x = torch.tensor(rows, dtype=torch.float32)
    return torch.cat([x, x], dim=1)  # [8, 32]


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits,group", [(2, 32), (2, 16), (4, 32), (4, 16)])
def test_quantize_rows_match_quant(tdevice, scale_dtype, bits, group):
    x = _corner_rows()
    R, D = x.shape
    codes = torch.empty(R, D * bits // 8, dtype=torch.uint8, device=tdevice)
    scale = torch.empty(R, D // group, dtype=scale_dtype, device=tdevice)
    zero = torch.empty_like(scale)
    _quantize_kernel[(1,)](x.to(tdevice), codes, scale, zero, R=R, D=D, BITS=bits, GROUP=group,
                           SCALE_DT=_TL_DTYPE[scale_dtype], enable_fp_fusion=False)
    want = quant.quantize(x, bits, group, clip_ratio=1.0, scale_dtype=scale_dtype)
    for got, exp, name in zip((codes, scale, zero), want, ("codes", "scale", "zero"), strict=True):
        assert torch.equal(got.cpu(), exp), name


def test_corner_rows_reach_the_ties():
    """The rows above do reach what they are for (else the test above proves less than it says)."""
    x = _corner_rows()
    s = (x[:4].amax(1) - x[:4].amin(1)) / 3
    y = x[:2] / s[:2, None] - x[:2].amin(1, keepdim=True) / s[:2, None]
    assert bool(((y - y.floor()) == 0.5).any(dim=1).all())  # x.5 codes
    assert s[2].item() == 1 + 3 * 2.0 ** -8 and s[2].to(torch.bfloat16).item() == 1 + 2.0 ** -6  # bf16 ties

    z = -x[3].amin() / s[3]
    assert z.item() == 1 + 2.0 ** -8 and z.to(torch.bfloat16).item() == 1.0
