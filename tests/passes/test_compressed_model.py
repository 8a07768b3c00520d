"""The handle apply() returns: its report, per-layer formats, op constants and prefill semantics,
and that the model it rewrote carries none of it as an attribute."""
import gc
import weakref

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.cache.hf_cache import OscarCache
from oscar_compile.checkpoint import save_compressed
from oscar_compile.formats.cache import LayerFormat
from oscar_compile.formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT
from oscar_compile.passes import ApplyReport, CompressedModel, set_prefill_semantics
from oscar_compile.passes.apply import resolve_layers
from oscar_compile.tensor_parallel.shard import shard_model
from oscar_compile.testing import tiny_model

NUM_LAYERS, HEAD_DIM = 3, 32
# layer 1 kept at 16 bits beside INT2 layers 0 and 2: the INT-b ops with bits = 16 (16-bit rows)
SPEC = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"rotation": "hadamard", "clip_ratio": 0.9},
    "value": {"rotation": "hadamard", "clip_ratio": 0.85},
    "layers": [{"match": [1], "kv_cache": {"bits": 16}}],
})


def _model():
    return tiny_model("qwen3", num_layers=NUM_LAYERS, head_dim=HEAD_DIM, vocab_size=64, seed=4)


def _applied():
    model = _model()
    return model, apply(model, SPEC, calibrate(model, SPEC))  # hadamard: no data needed


def _cache_of(model) -> OscarCache:
    out = model(torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0)), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, OscarCache)
    return cache


def test_the_handle_holds_the_model_and_the_report():
    model, compressed = _applied()
    assert isinstance(compressed, CompressedModel) and compressed.model is model
    report = compressed.report
    assert isinstance(report, ApplyReport)
    assert [r.index for r in report.layers] == list(range(NUM_LAYERS))
    assert [r.bits for r in report.layers] == [2, 16, 2]
    assert report.fused["rope"] == NUM_LAYERS  # fuse is on by default
    assert str(compressed) == str(report)  # print(apply(...)) prints the per-layer table
    assert "model" not in repr(compressed)  # the repr does not dump the module


def test_the_formats_are_the_fitted_spec_per_layer():
    _, compressed = _applied()
    expected = tuple(LayerFormat.of(layer) for layer in resolve_layers(compressed.report.spec, NUM_LAYERS))
    assert compressed.formats == expected
    assert [f.bits for f in compressed.formats] == [2, 16, 2]
    assert not any(f.full_precision_pages for f in compressed.formats)


def test_the_constants_are_those_the_graphs_pass_their_int_b_ops():
    model, compressed = _applied()
    assert sorted(compressed.constants) == [0, 1, 2]
    for i, c in compressed.constants.items():
        assert c.layer == compressed.formats[i]
        assert c.scale == pytest.approx(model.model.layers[i].self_attn.scaling) == HEAD_DIM ** -0.5
        assert (c.clip_k, c.clip_v) == pytest.approx((0.9, 0.85))


def test_layers_of_full_precision_pages_have_no_constants():
    """Nothing quantized: no windows, every layer on oscar::attention_bf16, no INT-b op to match."""
    bf16 = SPEC.model_copy(update={"kv_cache": SPEC.kv_cache.model_copy(update={"bits": 16}), "layers": []})
    model = _model()
    compressed = apply(model, bf16, calibrate(model, bf16))
    assert all(f.full_precision_pages for f in compressed.formats) and compressed.constants == {}
    assert {r.attention for r in compressed.report.layers} == {"oscar::attention_bf16"}


def test_the_prefill_semantics_reach_the_caches_the_forward_creates():
    model, compressed = _applied()
    assert compressed.prefill_semantics == DECODE_CONSISTENT  # the engine's default
    assert _cache_of(model).decode_consistent is compressed.constants
    compressed.set_prefill_semantics(PROMPT_EXACT)
    assert compressed.decode_consistent is None and _cache_of(model).decode_consistent is None
    set_prefill_semantics(model, DECODE_CONSISTENT)  # the function on the model reaches the same handle
    assert compressed.prefill_semantics == DECODE_CONSISTENT
    assert _cache_of(model).decode_consistent is compressed.constants
    with pytest.raises(ValueError, match="prefill semantics must be one of"):
        compressed.set_prefill_semantics("decode")
    with pytest.raises(ValueError, match="needs a model rewritten"):
        set_prefill_semantics(_model(), PROMPT_EXACT)


def test_no_attribute_is_left_on_the_model():
    model = _model()
    before = {id(m): set(vars(m)) for m in model.modules()}
    report = shard_model(model, rank=0, world_size=1)  # returned, not written on the model
    assert report.world_size == 1 and set(vars(model)) == before[id(model)]
    compressed = apply(model, SPEC, calibrate(model, SPEC))
    assert set(vars(model)) == before[id(model)]
    added = {name for m in model.modules() for name in set(vars(m)) - before.get(id(m), set())}
    assert not any(name.startswith("_oscar") for name in added)
    # the model is still known as rewritten, from its graphs: the doors that need it as loaded refuse
    with pytest.raises(RuntimeError, match="already applied"):
        apply(model, SPEC, calibrate(model, SPEC))
    with pytest.raises(ValueError, match="before apply"):
        save_compressed(model, SPEC, calibrate(model, SPEC), "unused")
    with pytest.raises(RuntimeError, match="before oscar_compile.apply"):
        shard_model(model, rank=0, world_size=1)
    assert compressed.model is model


def test_the_handle_lives_as_long_as_the_model():
    """generate() after apply() needs no kept handle: the model's hook holds it, and the lookup of
    set_prefill_semantics holds neither model nor handle alive."""
    model = _model()
    ref = weakref.ref(apply(model, SPEC, calibrate(model, SPEC)))
    assert ref() is not None
    set_prefill_semantics(model, PROMPT_EXACT)
    assert ref().prefill_semantics == PROMPT_EXACT
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None and ref() is None
