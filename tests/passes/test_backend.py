"""The torch.compile path: the dynamo graph holds the oscar ops, no SDPA on quantized layers."""
import copy

import pytest
import torch

import oscar_compile
from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.testing import tiny_model


def _spec(**layers):
    return CompressionSpec.from_dict({
        "kv_cache": {"bits": 2, "group_size": 32, "sink_tokens": 16, "recent_tokens": 16},
        "key": {"center": True}, "value": {"granularity": "per_head"}, **layers,
    })


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_compiled_graph_holds_oscar_ops_and_matches_eager_apply(arch):
    torch._dynamo.reset()
    model = tiny_model(arch, num_layers=3)
    spec = _spec(layers=[{"match": [2], "kv_cache": {"bits": 16}}])
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(0))
    rot = calibrate(model, spec, [ids])
    eager = copy.deepcopy(model)
    apply(eager, spec, rot)
    backend = oscar_compile.backend(spec, rot)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(ids, use_cache=False).logits
        expected = eager(ids, use_cache=False).logits
    assert torch.allclose(out, expected, atol=1e-4)
    code = "\n".join(g.code for g in backend.graphs)
    assert code.count("torch.ops.oscar.attention") == 2  # layers 0 and 1
    assert code.count("scaled_dot_product_attention") == 1  # layer 2, kept at 16 bits
    assert code.count("torch.ops.oscar.rotate") == 8  # q, k, v, out on each rewritten layer
