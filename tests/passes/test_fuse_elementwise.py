"""apply(fuse=True): the fused ops change no value on the CPU, and unknown formulas are left alone."""
import copy

import pytest
import torch
from torch import nn

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.passes.fuse_elementwise import fuse_gated_mlps, fuse_rms_norms
from oscar_compile.testing import tiny_model


def _spec(bits, center=True):
    return CompressionSpec.from_dict({
        "kv_cache": {"bits": bits, "group_size": 32, "sink_tokens": 16, "recent_tokens": 16},
        "key": {"rotation": "oscar", "granularity": "per_head", "center": center},
        "value": {"rotation": "oscar", "granularity": "per_head"},
    })


def _ids(shape, seed):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def _decode_logits(model, ids, steps=6):
    """Prefill, then teacher-forced single-token steps through the returned cache."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :-steps], use_cache=True)
        cache, logits = getattr(out, "cache", None) or out.past_key_values, [out.logits]
        for t in range(ids.shape[1] - steps, ids.shape[1]):
            step = model(input_ids=ids[:, t:t + 1], past_key_values=cache)
            logits.append(step.logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("bits", [16, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_gives_the_unfused_logits_bitwise(arch, bits, dtype):
    model = tiny_model(arch, num_heads=8, num_kv_heads=2, dtype=dtype)
    spec = _spec(bits)
    rot = calibrate(model, spec, [_ids((2, 32), 0)])
    fused, plain = copy.deepcopy(model), copy.deepcopy(model)
    report = apply(fused, spec, rot).report
    apply(plain, spec, rot, fuse=False)
    norms_per_layer = 4 if arch == "qwen3" else 2  # + q_norm, k_norm
    assert report.fused == {"rms_norm": 2 * norms_per_layer + 1, "silu_mul": 2, "rope": 2, "qkv_gemm": 2,
                            "gate_up_gemm": 2}
    ids = _ids((2, 56), 1)  # 50-token prompt: past sink + recent, so INT2 pages are read
    assert torch.equal(_decode_logits(fused, ids), _decode_logits(plain, ids))


def test_merged_projections_keep_the_parameters_as_views():
    model = tiny_model("qwen2", num_heads=8, num_kv_heads=2)
    keys = set(model.state_dict())
    count = sum(p.numel() for p in model.parameters())
    spec = _spec(2)
    apply(model, spec, calibrate(model, spec, [_ids((2, 32), 0)]))
    assert set(model.state_dict()) == keys and sum(p.numel() for p in model.parameters()) == count
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    w, b = attn.oscar_qkv_weight, attn.oscar_qkv_bias
    rows = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
    for linear, start in zip((attn.q_proj, attn.k_proj, attn.v_proj), (0, rows[0], rows[0] + rows[1]), strict=True):
        assert linear.weight.data_ptr() == w[start].data_ptr() and linear.bias.data_ptr() == b[start:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.oscar_gate_up_weight[mlp.gate_proj.out_features].data_ptr()
    code = attn.oscar_graph.code
    assert ("linear(hidden_states, oscar_qkv_weight" in code and code.count("torch.narrow") == 3
            and "self.q_proj(" not in code)


class OffsetRMSNorm(nn.Module):
    """Gemma's norm scales by (1 + w): the same attributes, another formula."""

    def __init__(self, dim):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.randn(dim)), 1e-6

    def forward(self, x):
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight.float()) * h).to(x.dtype)


class SwappedMLP(nn.Module):
    """Gate and up exchanged: silu(up(x)) * gate(x) is a different function of the weights."""

    def __init__(self, dim, act=None):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.down_proj, self.act_fn = nn.Linear(2 * dim, dim, bias=False), act or nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


class GeluMLP(SwappedMLP):
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_other_formulas_are_left_alone():
    model = nn.Sequential(OffsetRMSNorm(16), SwappedMLP(16), GeluMLP(16, nn.GELU()))
    forwards = [vars(m).get("forward") for m in model]
    assert fuse_rms_norms(model) == 0 and fuse_gated_mlps(model) == (0, 0)
    assert [vars(m).get("forward") for m in model] == forwards
    assert fuse_gated_mlps(nn.Sequential(GeluMLP(16))) == (1, 1)  # the same class with SiLU is fused


def test_a_rope_of_another_formula_keeps_its_own_code(monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3

    def apply_rotary_pos_emb(q, k, cos, sin):  # interleaved: pairs (2i, 2i+1), not (i, i + D/2)
        def rot(x):
            pairs = x.unflatten(-1, (-1, 2))
            return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
        return q * cos.unsqueeze(1) + rot(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + rot(k) * sin.unsqueeze(1)

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    model = tiny_model("qwen3")
    spec = _spec(16)
    rot = calibrate(model, spec, [_ids((2, 32), 0)])
    fused, plain = copy.deepcopy(model), copy.deepcopy(model)
    report = apply(fused, spec, rot).report
    apply(plain, spec, rot, fuse=False)
    assert report.fused["rope"] == 0 and all("RoPE not fused" in " ".join(r.notes) for r in report.layers)
    code = fused.model.layers[0].self_attn.oscar_graph.code
    assert "apply_rotary_pos_emb" in code and "torch.ops.oscar.rotate" in code
    ids = _ids((2, 20), 1)
    assert torch.equal(_decode_logits(fused, ids), _decode_logits(plain, ids))
