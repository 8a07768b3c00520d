"""apply(): equivalence with quantization off, the folding identity, overrides and refusals."""
import copy

import pytest
import torch

from oscar_compile import ArtifactError, CompressionSpec, apply, calibrate
from oscar_compile.testing import tiny_model

# (arch, query heads, KV heads, head_dim, attention bias)
MODELS = [
    ("qwen3", 4, 2, 32, False),
    ("qwen3", 4, 4, 32, True),
    ("qwen2", 8, 2, 16, True),
    ("llama", 8, 1, 32, False),
    ("mistral", 6, 2, 16, False),
]
ROTATIONS = [
    ("none", "per_layer", False),
    ("hadamard", "per_layer", False),
    ("oscar", "per_layer", False),
    ("oscar", "per_head", False),
    ("oscar", "per_layer", True),
    ("oscar", "per_head", True),
]


def _spec(bits=16, rotation="oscar", granularity="per_layer", center=False, head_dim=32, **extra):
    return CompressionSpec.from_dict({
        "kv_cache": {"bits": bits, "group_size": head_dim, "sink_tokens": 16, "recent_tokens": 16},
        "key": {"rotation": rotation, "granularity": granularity, "center": center},
        "value": {"rotation": rotation, "granularity": granularity},
        **extra,
    })


def _calibration_batches(vocab=128):
    g = torch.Generator().manual_seed(123)
    return [torch.randint(0, vocab, (2, 32), generator=g)]


@pytest.mark.parametrize("arch, heads, kv_heads, head_dim, bias", MODELS, ids=lambda x: str(x))
@pytest.mark.parametrize("rotation, granularity, center", ROTATIONS, ids=lambda x: str(x))
def test_rotations_without_quantization_reproduce_the_logits(arch, heads, kv_heads, head_dim, bias, rotation,
                                                             granularity, center):
    model = tiny_model(arch, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, attention_bias=bias)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))
    reference = model(ids).logits
    spec = _spec(16, rotation, granularity, center, head_dim)
    rot = calibrate(model, spec, _calibration_batches())
    report = apply(model, spec, rot).report
    assert all(r.centered == center for r in report.layers)
    assert all(r.attention == "oscar::attention_bf16" for r in report.layers)  # paged full-precision ops
    assert (model(ids).logits - reference).abs().max() <= 1e-4
    # decoding through the cache also matches the original model's cached decoding
    out = model.generate(ids[:1, :10], max_new_tokens=6, do_sample=False)
    original = tiny_model(arch, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, attention_bias=bias)
    assert torch.equal(out, original.generate(ids[:1, :10], max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("granularity", ["per_layer", "per_head"])
def test_folding_identity(granularity):
    model = tiny_model("qwen2", num_heads=8, num_kv_heads=2, head_dim=16)
    before = copy.deepcopy(model)
    spec = _spec(2, "oscar", granularity, head_dim=16)
    apply(model, spec, calibrate(model, spec, _calibration_batches()))
    D, g = 16, 4
    for new, old in zip(model.model.layers, before.model.layers, strict=True):
        wv, wv0 = new.self_attn.v_proj.weight.double(), old.self_attn.v_proj.weight.double()
        wo, wo0 = new.self_attn.o_proj.weight.double(), old.self_attn.o_proj.weight.double()
        bv, bv0 = new.self_attn.v_proj.bias.double(), old.self_attn.v_proj.bias.double()
        assert not torch.allclose(wv, wv0)
        for j in range(8):
            h = j // g
            cols, rows = slice(j * D, (j + 1) * D), slice(h * D, (h + 1) * D)
            assert torch.allclose(wo[:, cols] @ wv[rows], wo0[:, cols] @ wv0[rows], atol=1e-5)
            assert torch.allclose(wo[:, cols] @ bv[rows], wo0[:, cols] @ bv0[rows], atol=1e-5)


@pytest.mark.parametrize("fuse", [True, False])
def test_graph_is_inspectable_and_report_lists_layers(fuse):
    model = tiny_model("qwen3")
    spec = _spec(2)
    report = apply(model, spec, calibrate(model, spec, _calibration_batches()), fuse=fuse).report
    code = model.model.layers[0].self_attn.oscar_graph.code
    rope_ops = ("torch.ops.oscar.rope",) if fuse else ("apply_rotary_pos_emb", "torch.ops.oscar.rotate")
    for op in (*rope_ops, "torch.ops.oscar.attention", "torch.ops.oscar.cache_write"):
        assert op in code
    assert ("torch.ops.oscar.rotate" in code) != fuse and ("apply_rotary_pos_emb" in code) != fuse
    assert "attention_site" not in code and "update" not in code
    text = str(report)
    assert "oscar::attention" in text and len(report.layers) == 2
    # two layers: 4 norms each (input, post-attention, q, k) + the final norm; one MLP and one RoPE each
    assert report.fused == ({"rms_norm": 9, "silu_mul": 2, "rope": 2, "qkv_gemm": 2, "gate_up_gemm": 2} if fuse else {})
    assert ("fused ops: rms_norm x9" in text) == fuse
    assert report.bits_per_element() == pytest.approx(2 + 32 / 32)  # fp16 scale + zero per 32-channel group


def test_layers_overridden_to_16_bits_keep_their_weights_and_full_precision():
    """An override to bits: 16 gets the paged ops with a 16-bit history beside the INT2 layer (same
    windows): no rotation, weights untouched. A prompt inside the windows quantizes nothing, so the
    logits are the original model's."""
    model = tiny_model("llama", num_layers=3)
    before = copy.deepcopy(model)
    spec = _spec(2, layers=[{"match": [0, -1], "kv_cache": {"bits": 16}}])
    report = apply(model, spec, calibrate(model, spec, _calibration_batches())).report
    assert [r.bits for r in report.layers] == [16, 2, 16]
    assert [r.key_rotation for r in report.layers] == ["none", "oscar", "none"]
    assert all(r.attention == "oscar::attention" for r in report.layers)
    for i in (0, 2):
        attn, old = model.model.layers[i].self_attn, before.model.layers[i].self_attn
        assert "overridden to 16 bits" in report.layers[i].notes[-1]
        assert torch.equal(attn.v_proj.weight, old.v_proj.weight) and torch.equal(attn.o_proj.weight, old.o_proj.weight)
    assert not torch.equal(model.model.layers[1].self_attn.v_proj.weight,
                           before.model.layers[1].self_attn.v_proj.weight)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(7))  # 24 < sink + recent
    with torch.no_grad():
        assert (model(ids).logits - before(ids).logits).abs().max() <= 1e-4
    # decoding past the windows: layer 0 (16 bits, nothing quantized before it) reads its history
    # rows back as they were, so its outputs stay the original model's
    rows = []
    hook = model.model.layers[0].register_forward_hook(
        lambda m, args, out: rows.append((out[0] if isinstance(out, tuple) else out)[0]))
    prompt = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        hook.remove()
        original = before.model.layers[0].register_forward_hook(
            lambda m, args, out: rows.append((out[0] if isinstance(out, tuple) else out)[0]))
        before(out[:, :-1])
    original.remove()
    assert torch.allclose(torch.cat(rows[:-1]), rows[-1], atol=1e-4)


def test_nothing_quantized_drops_the_windows():
    """Every layer at 16 bits: the classic paged cache (the runtime's BF16 mode), whatever the
    spec's windows; one quantized layer keeps them for every layer."""
    from oscar_compile.passes.apply import resolve_layers

    plain = resolve_layers(_spec(16), 3)
    assert all((layer.kv_cache.sink_tokens, layer.kv_cache.recent_tokens) == (0, 0) for layer in plain)
    mixed = resolve_layers(_spec(16, layers=[{"match": [1], "kv_cache": {"bits": 2}}]), 3)
    assert all((layer.kv_cache.sink_tokens, layer.kv_cache.recent_tokens) == (16, 16) for layer in mixed)
    assert [layer.key.rotation for layer in mixed] == ["oscar"] * 3  # not overridden to 16 bits: rotated


def test_refusals():
    model = tiny_model("qwen3")
    spec = _spec(2)
    rot = calibrate(model, spec, _calibration_batches())
    other = tiny_model("qwen3", num_kv_heads=4)
    with pytest.raises(ArtifactError, match="num_kv_heads"):
        apply(other, spec, rot)
    apply(model, spec, rot)
    with pytest.raises(RuntimeError, match="already applied"):
        apply(model, spec, rot)

    class Unknown(torch.nn.Module):
        pass

    with pytest.raises(NotImplementedError, match="does not know the architecture"):
        apply(Unknown(), spec, rot)
    no_means = calibrate(tiny_model("qwen3"), _spec(2, "hadamard"))
    with pytest.raises(ArtifactError, match="no key means"):
        apply(tiny_model("qwen3"), _spec(2, "hadamard", center=True), no_means)


def test_rewritten_16_bit_layers_run_without_a_cache():
    """use_cache=False hands the paged 16-bit ops an all-zero write range: nothing is written."""
    model = tiny_model("qwen3")
    reference = copy.deepcopy(model)
    spec = CompressionSpec.from_dict({"kv_cache": {"bits": 16}, "key": {"rotation": "none"},
                                      "value": {"rotation": "none"}})
    apply(model, spec, calibrate(model, spec, _calibration_batches()))
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(model(ids, use_cache=False).logits, reference(ids).logits, atol=1e-5)
