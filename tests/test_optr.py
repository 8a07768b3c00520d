"""OptR: the straight-through quantizer, refinement that never loses on held-out data, end to end."""
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.calibration.optr import LayerTraces, _HeadLosses, fake_quantize_ste, refine_layer
from oscar_compile.quant import clip_threshold, fake_quantize
from oscar_compile.rotation_math import orthogonality_error
from oscar_compile.testing import tiny_model

BASE = {"kv_cache": {"group_size": 32, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4}}


def test_straight_through_quantizer():
    x = torch.randn(6, 64, requires_grad=True)
    y = fake_quantize_ste(x, 2, 32, 0.9, "float16")
    # forward value: the reference quantizer's, up to the one rounding of clipped + (rounded - clipped)
    assert torch.allclose(y.detach(), fake_quantize(x.detach(), 2, 32, 0.9, "float16"), rtol=0, atol=1e-6)
    y.sum().backward()
    inside = (x.detach().abs() <= clip_threshold(x.detach(), 0.9)).float()
    assert torch.equal(x.grad, inside)  # 1 inside the clip range, 0 outside


def _traces(seed=0, S=4, H_q=4, H_kv=2, T=48, n=8, D=32, d_model=64):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, H_kv, T, D, generator=g)
    k[..., 3] *= 8  # an outlier channel: what rotations are for
    return LayerTraces(torch.randn(S, H_q, n, D, generator=g), k, torch.randn(S, H_kv, T, D, generator=g),
                       torch.randn(d_model, H_q * D, generator=g) / 8, D ** -0.5)


def test_refinement_lowers_the_training_loss_and_never_the_heldout_one():
    spec = CompressionSpec.from_dict({**BASE, "key": {"rotation": "optr"}, "value": {"rotation": "optr"},
                                      "optr": {"steps": 40, "eval_every": 10, "num_queries": 8}})
    layer = spec.for_layer(0, 1)
    data = _traces()
    base = torch.eye(32).expand(2, 32, 32).clone()
    rot_k, rot_v = refine_layer(data, layer, base, base, None, spec.optr)
    assert orthogonality_error(rot_k) < 1e-4 and orthogonality_error(rot_v) < 1e-4
    train = LayerTraces(data.q[:2], data.k[:2], data.v[:2], data.w_o, data.scale)
    held = LayerTraces(data.q[2:], data.k[2:], data.v[2:], data.w_o, data.scale)
    with torch.no_grad():
        for part, strict in ((train, True), (held, False)):
            losses = _HeadLosses(part, layer, None, 1.0)
            before, after = losses.key_loss(base), losses.key_loss(rot_k)
            assert torch.all(after <= before + 1e-7)
            if strict:
                assert after.sum() < 0.95 * before.sum()


def test_optr_end_to_end_is_exact_without_quantization():
    model = tiny_model("qwen3", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (2, 64), generator=g) for _ in range(2)]
    spec = CompressionSpec.from_dict({**BASE, "key": {"rotation": "optr", "center": True},
                                      "value": {"rotation": "optr"}, "optr": {"steps": 20, "num_queries": 16}})
    rot = calibrate(model, spec, batches)
    oscar = calibrate(model, CompressionSpec.from_dict({**BASE, "key": {"center": True}}), batches)
    assert not torch.allclose(rot.k[0], oscar.k[0])  # refined per head
    ids = torch.randint(0, 128, (1, 40), generator=g)
    reference = model(ids).logits
    exact = spec.model_copy(update={"kv_cache": spec.kv_cache.model_copy(update={"bits": 16})})
    apply(model, exact, rot)
    assert (model(ids).logits - reference).abs().max() <= 1e-4
