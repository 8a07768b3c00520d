"""Per-layer metrics: exactly zero for BF16, positive for naive INT2, and ordered as the bits are."""
import pytest
import torch

from oscar_compile import CompressionSpec, calibrate
from oscar_compile.evaluation.kivi import KiviConfig, KiviQuantizer
from oscar_compile.evaluation.layer_metrics import METRICS, LayerMetrics
from oscar_compile.evaluation.quantizers import spec_quantizers
from oscar_compile.testing import tiny_model

VOCAB, LAYERS, D = 64, 2, 32


def _spec(rotation="none", bits=2, clip=1.0):
    return CompressionSpec.from_dict({
        "kv_cache": {"bits": bits, "group_size": 32, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
        "key": {"rotation": rotation, "clip_ratio": clip}, "value": {"rotation": rotation, "clip_ratio": clip}})


@pytest.fixture(scope="module")
def results():
    model = tiny_model("qwen3", num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=D, vocab_size=VOCAB, seed=3)
    ids = torch.randint(0, VOCAB, (3, 64), generator=torch.Generator().manual_seed(0))
    methods = {"bf16": [None] * LAYERS, "kivi": [KiviQuantizer(KiviConfig(group_size=8, residual=16), D)] * LAYERS}
    for name, spec in (("naive-int2", _spec()), ("oscar-int4", _spec("oscar", 4, 0.99))):
        rot = calibrate(model, spec, [ids])
        methods[name] = spec_quantizers([spec.for_layer(i, LAYERS) for i in range(LAYERS)], rot, D, torch.device("cpu"))
    metrics = LayerMetrics(model, methods, num_scored=16)
    with torch.inference_mode():
        for batch in ids.split(2):
            metrics.add_batch(batch)
    return metrics.results()


def test_bf16_is_exactly_zero(results):
    assert all(layer[m] == 0.0 for layer in results["bf16"] for m in METRICS)


@pytest.mark.parametrize("method", ["naive-int2", "kivi", "oscar-int4"])
def test_quantized_methods_are_positive(results, method):
    assert all(layer[m] > 0.0 for layer in results[method] for m in METRICS)


def test_int4_is_closer_than_naive_int2(results):
    for a, b in zip(results["oscar-int4"], results["naive-int2"], strict=True):
        assert all(a[m] < b[m] for m in METRICS)


def test_relative_errors_are_sane(results):
    """INT2 min-max of Gaussian-like data loses about a tenth to a third of the energy, not more than all."""
    for layer in results["naive-int2"]:
        assert 0.01 < layer["k_rel_mse"] < 1 and 0.01 < layer["v_rel_mse"] < 1
