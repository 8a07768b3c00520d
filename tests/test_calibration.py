import pytest
import torch

from oscar_compile import CompressionSpec, calibrate
from oscar_compile.calibration.capture import capture_attention
from oscar_compile.testing import tiny_model

SPEC = {"kv_cache": {"group_size": 32}}


def _batches(vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 24), generator=g), torch.randint(0, vocab, (1, 40), generator=g)]


def _captured(model, batches):
    seen = {}
    with torch.no_grad(), capture_attention(model, lambda i, q, k, v, o: seen.setdefault(i, []).append((q, k, v, o))):
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    return seen


def _brute_force_targets(records, num_kv_heads):
    """The DESIGN §3 targets computed directly from every captured token."""
    q = torch.cat([r[0].transpose(1, 2).reshape(-1, r[0].shape[1], r[0].shape[3]) for r in records]).double()
    k = torch.cat([r[1].transpose(1, 2).reshape(-1, r[1].shape[1], r[1].shape[3]) for r in records]).double()
    v = torch.cat([r[2].transpose(1, 2).reshape(-1, r[2].shape[1], r[2].shape[3]) for r in records]).double()
    o = torch.cat([r[3].reshape(-1, r[3].shape[2], r[3].shape[3]) for r in records]).double()  # [N, H_q, D]
    N, H_q, D = q.shape
    g = H_q // num_kv_heads
    cq, cs, cv, mean = [], [], [], []
    for h in range(num_kv_heads):
        heads = range(h * g, (h + 1) * g)
        cq.append(sum(q[:, i].T @ q[:, i] for i in heads) / (N * g))
        cs.append(sum(o[:, i].T @ o[:, i] for i in heads) / (N * g))
        w = torch.stack([k[t, h] @ cq[h] @ k[t, h] for t in range(N)])
        w = w / w.mean()
        cv.append(sum(w[t] * torch.outer(v[t, h], v[t, h]) for t in range(N)) / N)
        mean.append(k[:, h].mean(0))
    return torch.stack(cq), torch.stack(cs), torch.stack(cv), torch.stack(mean)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)])
def test_targets_equal_brute_force(num_heads, num_kv_heads):
    model = tiny_model("qwen3", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16)
    batches = _batches()
    records = _captured(model, batches)
    for target in ("score_weighted", "attention_output"):
        spec = CompressionSpec.from_dict({"kv_cache": {"group_size": 16}, "key": {"granularity": "per_head"},
                                          "value": {"granularity": "per_head", "target": target}})
        rot = calibrate(model, spec, batches)
        for layer in range(2):
            cq, cs, cv, mean = _brute_force_targets(records[layer], num_kv_heads)
            assert torch.allclose(rot.extra(layer, "k_cov").double(), cq, rtol=1e-4, atol=1e-5)
            expected_v = cv if target == "score_weighted" else cs
            assert torch.allclose(rot.extra(layer, "v_cov").double(), expected_v, rtol=1e-4, atol=1e-5)
            assert torch.allclose(rot.k_mean[layer].double(), mean, rtol=1e-4, atol=1e-5)
        assert rot.num_tokens == 2 * 24 + 40


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("granularity", ["per_layer", "per_head"])
def test_calibration_end_to_end_leaves_outputs_unchanged(arch, granularity):
    model = tiny_model(arch, num_heads=4, num_kv_heads=2, head_dim=32)
    ids = torch.randint(0, 128, (2, 16))
    before = model(ids).logits
    spec = CompressionSpec.from_dict({**SPEC, "key": {"granularity": granularity},
                                      "value": {"granularity": granularity}})
    rot = calibrate(model, spec, _batches())
    assert torch.equal(model(ids).logits, before)
    assert model.config._attn_implementation == "sdpa"
    assert rot.k[0].shape == (2, 32, 32)
    if granularity == "per_layer":
        assert torch.equal(rot.k[1][0], rot.k[1][1])
    else:
        assert not torch.equal(rot.k[1][0], rot.k[1][1])


def test_padding_mask_excludes_tokens():
    model = tiny_model("qwen3", head_dim=16)
    ids = torch.randint(0, 128, (1, 20))
    spec = CompressionSpec.from_dict({"kv_cache": {"group_size": 16}, "value": {"target": "attention_output"}})
    plain = calibrate(model, spec, [ids[:, :12]])
    mask = torch.zeros(1, 20, dtype=torch.long)
    mask[:, :12] = 1
    masked = calibrate(model, spec, [{"input_ids": ids, "attention_mask": mask}])
    assert masked.num_tokens == 12
    assert torch.allclose(masked.extra(0, "k_cov"), plain.extra(0, "k_cov"), atol=1e-6)


def test_data_free_rotations_and_input_errors():
    model = tiny_model("qwen3", head_dim=16)
    spec = CompressionSpec.from_dict({"kv_cache": {"group_size": 16}, "key": {"rotation": "hadamard"},
                                      "value": {"rotation": "none"}})
    rot = calibrate(model, spec)
    assert torch.equal(rot.v[0][0], torch.eye(16)) and rot.num_tokens == 0 and rot.k_mean[0] is None
    oscar = CompressionSpec.from_dict({"kv_cache": {"group_size": 16}})
    with pytest.raises(ValueError, match="pass batches"):
        calibrate(model, oscar)
    with pytest.raises(TypeError, match="re-iterable"):
        calibrate(model, oscar, iter(_batches()))
    with pytest.raises(TypeError, match=r"\[B, T\]"):
        calibrate(model, oscar, [torch.zeros(5, dtype=torch.long)])


def test_calibration_on_an_accelerate_dispatched_model():
    from accelerate import dispatch_model

    model = tiny_model("llama", head_dim=16)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    reference = calibrate(model, CompressionSpec.from_dict({"kv_cache": {"group_size": 16}}), _batches())
    dispatched = dispatch_model(model, device_map=device_map)
    rot = calibrate(dispatched, CompressionSpec.from_dict({"kv_cache": {"group_size": 16}}), _batches())
    assert torch.allclose(rot.k[1], reference.k[1]) and torch.allclose(rot.v[0], reference.v[0])


def test_unknown_architecture_is_refused():
    class Other(torch.nn.Module):
        pass

    with pytest.raises(NotImplementedError, match="does not know the architecture 'Other'"):
        calibrate(Other(), CompressionSpec())
