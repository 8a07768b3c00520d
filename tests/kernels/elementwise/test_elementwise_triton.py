"""Triton rms_norm / rope / silu_mul against their references (elementwise_ref.py).

Tolerances: without a rotation RoPE rounds exactly where the reference rounds (each product, then
the sum) and is compared bitwise. RMSNorm sums x^2 in another order and rsqrt may differ in the
last float32 bit, which can move the rounded output by one ulp of its dtype. The rotation sums
D float32 products in another order: float32 rounding (~1e-6 relative) before the output's own
rounding, so again at most an ulp. SiLU's exp may differ by a float32 ulp: one output ulp.
"""
from __future__ import annotations

import pytest
import torch

from oscar_compile.kernels.elementwise.elementwise_ref import rms_norm_ref, rope_ref, silu_mul_ref

ULP = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -7}  # a spacing of the dtype, relative to |x|


def _rand(shape, dtype, device, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def _truncating(got) -> bool:
    return got.device.type == "cpu" and got.dtype == torch.bfloat16


def _loosely(got, want):
    """Relative Frobenius error < 1e-2, for bf16 results under the interpreter only: its float32 ->
    bfloat16 casts truncate where the GPU and torch round to nearest, and the bf16 formulas round
    after every op, so where terms cancel (x cos + rotate_half(x) sin) the difference has the size
    of a spacing of the terms, not of the result, and an elementwise ulp bound fails (hundreds of
    result spacings measured). Indexing or masking errors are O(1); on a GPU these tests compare
    bitwise or within one spacing."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


def _within_ulp(got, want):
    if _truncating(got):
        return _loosely(got, want)
    assert got.shape == want.shape and got.dtype == want.dtype
    bound = ULP[want.dtype] * want.float().abs().clamp_min(1e-3) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 64), (2, 3, 8, 128), (5, 4096), (3, 96)])
def test_rms_norm(tdevice, dtype, shape):
    from oscar_compile.kernels.elementwise.elementwise_triton import rms_norm_triton

    x, w = _rand(shape, dtype, tdevice, 0), _rand(shape[-1:], dtype, tdevice, 1)
    _within_ulp(rms_norm_triton(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


def test_rms_norm_reads_strided_inputs(tdevice):
    from oscar_compile.kernels.elementwise.elementwise_triton import rms_norm_triton

    w = _rand((64,), torch.float32, tdevice, 3)
    x = _rand((4, 6, 64), torch.float32, tdevice, 2).transpose(0, 1)  # rows not contiguous
    _within_ulp(rms_norm_triton(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    # the key heads of a merged q/k/v projection: [B, T, H, D] rows, token stride 10 * 64
    qkv = _rand((2, 3, 10 * 64), torch.float32, tdevice, 4)
    k = qkv.narrow(-1, 6 * 64, 2 * 64).view(2, 3, 2, 64)
    _within_ulp(rms_norm_triton(k, w, 1e-5), rms_norm_ref(k, w, 1e-5))


def _rope_inputs(B, H_q, H_kv, T, D, dtype, device):
    # as attention modules hand them over: [B, T, H, D] storage seen as [B, H, T, D]
    q = _rand((B, T, H_q, D), dtype, device, 4).transpose(1, 2)
    k = _rand((B, T, H_kv, D), dtype, device, 5).transpose(1, 2)
    angles = torch.rand(B, T, D // 2, generator=torch.Generator().manual_seed(6)) * 6.3
    emb = torch.cat((angles, angles), -1)
    return q, k, emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _rotations(H_r, D, device, seed=7):
    gen = torch.Generator().manual_seed(seed)
    rot = torch.linalg.qr(torch.randn(H_r, D, D, generator=gen))[0]
    return rot.to(device), torch.randn(H_r, D, generator=gen).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H_q,H_kv,T,D", [(1, 4, 4, 1, 64), (2, 8, 2, 3, 128), (1, 16, 2, 5, 64), (3, 2, 1, 2, 32)])
def test_rope_without_rotation_is_bitwise(tdevice, dtype, B, H_q, H_kv, T, D):
    from oscar_compile.kernels.elementwise.elementwise_triton import rope_triton

    q, k, cos, sin = _rope_inputs(B, H_q, H_kv, T, D, dtype, tdevice)
    if B > 1:  # positions shared by the batch: cos / sin [1, T, D], broadcast
        cos, sin = cos[:1], sin[:1]
    got, want = rope_triton(q, k, cos, sin), rope_ref(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        assert g.stride() == w.stride()  # token-major storage, as the paged ops read it
        if _truncating(g):
            _loosely(g, w)
        else:
            assert torch.equal(g, w)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("col_blocks", [1, None, 4], ids=["whole", "planned", "4cols"])
@pytest.mark.parametrize("B,H_q,H_kv,T,D,dtype", [
    (1, 4, 4, 1, 64, torch.float32), (2, 8, 2, 3, 128, torch.float32), (1, 16, 2, 2, 64, torch.bfloat16),
    (2, 2, 2, 5, 32, torch.float32), (2, 8, 2, 41, 64, torch.float32), (2, 8, 2, 1, 64, torch.float32),
    (2, 16, 2, 2, 64, torch.float32), (2, 8, 2, 41, 64, torch.bfloat16), (1, 32, 8, 70, 128, torch.bfloat16)])
def test_rope_with_rotation(tdevice, per_head, centred, col_blocks, B, H_q, H_kv, T, D, dtype):
    """The rotation's output columns in one program or split over several (rope_column_blocks);
    tokens packed into a program's 16 rows: 3 (G = 4; in an 82-token prefill the last program
    is partial and sequences meet inside programs), 2 (a batch-2 decode step), 8 (G = 1), 1
    (G = 8, each program its own sequence's cos / sin row). The bf16 prefills of 82 and 70 tokens
    take the tensor cores (bf16x3) in 64-row programs of 12 and 6 tokens, the last one partial."""
    from oscar_compile.kernels.elementwise.elementwise_triton import rope_triton

    q, k, cos, sin = _rope_inputs(B, H_q, H_kv, T, D, dtype, tdevice)
    rot, mean = _rotations(H_kv if per_head else 1, D, tdevice)
    mean = mean if centred else None
    got_both = rope_triton(q, k, cos, sin, rot, mean, col_blocks=col_blocks)
    for got, want in zip(got_both, rope_ref(q, k, cos, sin, rot, mean), strict=True):
        if dtype == torch.float32:  # float32 sums in another order: relative 1e-6, not an ulp of |x|
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            _within_ulp(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 96), (3, 2, 1000)])
@pytest.mark.parametrize("merged", [False, True])
def test_silu_mul(tdevice, dtype, shape, merged):
    from oscar_compile.kernels.elementwise.elementwise_triton import silu_mul_triton

    if merged:  # the two halves of one gate/up GEMM's output
        both = _rand((*shape[:-1], 2 * shape[-1]), dtype, tdevice, 8)
        gate, up = both[..., :shape[-1]], both[..., shape[-1]:]
    else:
        gate, up = _rand(shape, dtype, tdevice, 8) * 4, _rand(shape, dtype, tdevice, 9)
    got, want = silu_mul_triton(gate, up), silu_mul_ref(gate, up)
    if _truncating(got):
        return _loosely(got, want)
    # one ulp of the rounded silu, carried through the product, plus the product's own rounding
    bound = 2 * ULP[dtype] * (torch.nn.functional.silu(gate.float()).abs() * up.float().abs()).clamp_min(1e-3) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_rope_precision_plan(monkeypatch):
    """Prefill-sized bf16 calls rotate on the tensor cores; decode steps, other dtypes and
    deterministic mode keep the float32 products (one K order for every token count)."""
    from oscar_compile.kernels.elementwise import elementwise_triton as ew

    assert ew.rope_precision(ew.MMA_MIN_TOKENS, torch.bfloat16) == "bf16x3"
    assert ew.rope_precision(ew.MMA_MIN_TOKENS - 1, torch.bfloat16) == "ieee"
    assert ew.rope_precision(8192, torch.float16) == "ieee"
    assert ew.rope_precision(8192, torch.float32) == "ieee"
    monkeypatch.setattr(ew, "is_deterministic", lambda: True)
    assert ew.rope_precision(8192, torch.bfloat16) == "ieee"


def test_rope_refuses_an_inexact_bf16x3():
    from oscar_compile.kernels.elementwise.elementwise_triton import rope_triton

    q, k, cos, sin = _rope_inputs(1, 4, 2, 3, 32, torch.float32, "cpu")
    rot, mean = _rotations(1, 32, "cpu")
    with pytest.raises(ValueError, match="bf16x3 takes bfloat16"):
        rope_triton(q, k, cos, sin, rot, mean, precision="bf16x3")
    with pytest.raises(ValueError, match="precision must be one of"):
        rope_triton(q, k, cos, sin, rot, mean, precision="fp8")


def test_rope_column_plan():
    from oscar_compile.kernels.elementwise.elementwise_triton import rope_column_blocks

    cpu = torch.device("cpu")  # stands for 4 SMs
    assert rope_column_blocks(1, 128, cpu) == 8  # down to 16 columns
    assert rope_column_blocks(2, 128, cpu) == 4  # 8 programs: two per SM
    assert rope_column_blocks(8, 128, cpu) == 1  # already two programs per SM
    assert rope_column_blocks(1, 32, cpu) == 2


def test_rope_column_blocks_must_tile_the_head():
    from oscar_compile.kernels.elementwise.elementwise_triton import rope_triton

    q, k, cos, sin = _rope_inputs(1, 4, 2, 1, 64, torch.float32, "cpu")
    rot, mean = _rotations(1, 64, "cpu")
    with pytest.raises(ValueError, match="col_blocks"):
        rope_triton(q, k, cos, sin, rot, mean, col_blocks=3)


def test_rope_leaves_what_the_kernel_cannot_take_to_the_reference():
    pytest.importorskip("triton")
    from oscar_compile.kernels.elementwise.elementwise_triton import rope_supported

    def inputs(D=128, H_q=8, dtype=torch.bfloat16, cos_dtype=torch.bfloat16):
        q, k, cos, sin = _rope_inputs(1, H_q, 2, 3, D, dtype, "cpu")
        return q, k, cos.to(cos_dtype), sin.to(cos_dtype)

    assert rope_supported(*inputs())
    assert not rope_supported(*inputs(D=96))  # a multiple of 32 but not a power of two
    assert not rope_supported(*inputs(cos_dtype=torch.float32))  # HF would promote the products
    q, k, cos, sin = inputs()
    assert not rope_supported(q[..., ::2], k[..., ::2], cos[..., ::2], sin[..., ::2])  # strided last dim
