"""The KIVI-style baseline: quantizer error bounds, its cache timing, bits, and the 4-copy attention."""
import pytest
import torch

from oscar_compile.evaluation.kivi import (
    KiviConfig,
    KiviQuantizer,
    kivi_bits_per_element,
    kivi_fake_quantize_keys,
    kivi_fake_quantize_values,
    parse_kivi_name,
)
from oscar_compile.evaluation.quantizers import cache_starts
from oscar_compile.evaluation.simulate import mixed_attention


def _half_step(x: torch.Tensor, dim: int, group: int, bits: int) -> torch.Tensor:
    """Per-element bound of min-max rounding along ``dim`` in groups: half a step s / 2 with
    s = (max - min) / (2^b - 1) of the group, plus fp16 rounding of s and the minimum (2^-11 relative
    each, doubled for slack)."""
    xg = x.movedim(dim, -1).unflatten(-1, (-1, group))
    lo = xg.amin(-1, keepdim=True)
    rng = xg.amax(-1, keepdim=True) - lo
    bound = rng / (2**bits - 1) / 2 + (rng + lo.abs()) * 2**-10
    return bound.expand_as(xg).flatten(-2).movedim(-1, dim)


@pytest.mark.parametrize("bits", [2, 4])
def test_keys_per_channel_over_token_groups_within_half_a_step(bits):
    cfg = KiviConfig(bits=bits, group_size=8, residual=16)
    k = torch.randn(2, 3, 37, 16) * torch.linspace(0.1, 5, 16)  # channels of very different scales
    kq = kivi_fake_quantize_keys(k, cfg)
    full = 32  # 4 complete groups of 8 tokens; the 5 tail tokens are KIVI's residual
    err = (kq[:, :, :full] - k[:, :, :full]).abs()
    assert (err <= _half_step(k[:, :, :full], 2, 8, bits) + 1e-6).all()
    assert torch.equal(kq[:, :, full:], k[:, :, full:])
    assert err.max() > 0


@pytest.mark.parametrize("bits", [2, 4])
def test_values_per_token_within_half_a_step(bits):
    cfg = KiviConfig(bits=bits, group_size=8, residual=16)
    v = torch.randn(2, 3, 20, 16)
    err = (kivi_fake_quantize_values(v, cfg) - v).abs()
    assert (err <= _half_step(v, -1, 8, bits) + 1e-6).all()


def test_nearly_constant_groups_stay_finite():
    """A repeated token in a slowly rotating channel: range 1e-6 around 3.0 (a zero point -min/s would
    be 3e6, past fp16's 65504)."""
    cfg = KiviConfig(group_size=4, residual=8)
    k = 3.0 + 1e-6 * torch.arange(8.0).reshape(1, 1, 8, 1).expand(1, 1, 8, 4)
    kq = kivi_fake_quantize_keys(k, cfg)
    assert torch.isfinite(kq).all() and (kq - k).abs().max() < 1e-2


def test_constant_groups_round_trip_exactly():
    cfg = KiviConfig(group_size=4, residual=8)
    k = torch.full((1, 1, 8, 4), 0.375)
    assert torch.equal(kivi_fake_quantize_keys(k, cfg), k)
    assert torch.equal(kivi_fake_quantize_values(k, cfg), k)


def test_cache_timing_follows_kivi():
    """Keys: residual flushed in blocks of R; values: the R most recent stay full precision."""
    q = KiviQuantizer(KiviConfig(group_size=4, residual=8), head_dim=8)
    b = q.bounds(cache_starts(20))  # teacher-forced decode: query t sees t cached tokens
    mk, mv = b.masks(20)
    assert mk[0, 7].sum() == 0 and mk[0, 8].sum() == 8 and mk[0, 15].sum() == 8 and mk[0, 16].sum() == 16
    assert mv[0, 8].sum() == 0 and mv[0, 9].sum() == 1 and mv[0, 19].sum() == 11


def test_names_and_bits():
    assert parse_kivi_name("kivi-int2") == KiviConfig()
    assert parse_kivi_name("kivi-int4-g128-r256") == KiviConfig(bits=4, group_size=128, residual=256)
    assert parse_kivi_name("kivi-int3") is None and parse_kivi_name("oscar-int2") is None
    with pytest.raises(ValueError, match="multiple"):
        parse_kivi_name("kivi-int2-g32-r100")
    assert kivi_bits_per_element(KiviConfig()) == 3.0  # 2 + 2 * 16 / 32
    # C = 200, R = 128: keys 128 quantized + 72 full; values 72 quantized + 128 full
    assert kivi_bits_per_element(KiviConfig(), 200) == pytest.approx((200 * 3 + 200 * 16) / 400)


def test_four_copy_attention_equals_the_explicit_mixture():
    """KIVI's keys and values age out at different times: query t reads k_q[p] iff mk, v_q[p] iff mv."""
    g = torch.Generator().manual_seed(0)
    B, H_q, H_kv, T, D = 2, 4, 2, 24, 8
    q = torch.randn(B, H_q, T, D, generator=g)
    k, v, kq, vq = (torch.randn(B, H_kv, T, D, generator=g) for _ in range(4))
    quant = KiviQuantizer(KiviConfig(group_size=4, residual=8), head_dim=D)
    mk, mv = quant.bounds(cache_starts(T, prefill=5)).masks(T)
    out = mixed_attention(q, k, v, kq, vq, mk, mv, D**-0.5)

    def rep(x):
        return x.repeat_interleave(H_q // H_kv, 1)

    s = torch.where(mk[:, None], q @ rep(kq).transpose(-1, -2), q @ rep(k).transpose(-1, -2)) * D**-0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = s.softmax(-1)
    expected = (p * ~mv[:, None]) @ rep(v) + (p * mv[:, None]) @ rep(vq)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)
