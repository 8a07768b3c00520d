"""Decode-consistent prefill through ``apply()`` + the HF cache (``generate()``'s path), and the
evaluation's simulation of it: prompt logits equal teacher-forced decode steps, chunking changes
nothing, and the eval measures what this path computes. It is what a freshly applied model runs
(the default); prompt-exact is asked for with ``set_prefill_semantics``. float32 tiny models:
logits agree to 1e-4 (float summation order), greedy tokens are identical."""

import functools
import os

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.evaluation.quantizers import cache_starts, spec_quantizers
from oscar_compile.evaluation.simulate import simulated_logits
from oscar_compile.formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT
from oscar_compile.passes.apply import set_prefill_semantics
from oscar_compile.testing import tiny_model

SINK, RECENT, VOCAB, LEN = 4, 8, 64, 40
MODEL = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=VOCAB, seed=3)


@functools.cache
def _setup():
    spec = CompressionSpec.from_dict(
        {
            "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": SINK, "recent_tokens": RECENT, "page_size": 4},
            "key": {"rotation": "oscar", "center": True, "clip_ratio": 0.9},
            "value": {"rotation": "oscar", "granularity": "per_head", "clip_ratio": 0.85},
        }
    )
    model = tiny_model("qwen3", **MODEL)
    rot = calibrate(model, spec, [torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))])
    compressed = tiny_model("qwen3", **MODEL)
    apply(compressed, spec, rot)
    quantizers = spec_quantizers([spec.for_layer(i, 2) for i in range(2)], rot, 32, torch.device("cpu"))
    return model, compressed, quantizers


def _ids():
    return torch.randint(0, VOCAB, (2, LEN), generator=torch.Generator().manual_seed(5))


def _logits_in_chunks(model, ids, chunk: int) -> torch.Tensor:
    cache, out = None, []
    for part in ids.split(chunk, dim=1):
        res = model(input_ids=part, past_key_values=cache, use_cache=True)
        cache = getattr(res, "cache", None) or res.past_key_values
        out.append(res.logits)
    return torch.cat(out, dim=1)


@pytest.fixture
def decode_consistent():
    """The applied model as apply() left it: decode-consistent, the default."""
    _, compressed, _ = _setup()
    return compressed


@pytest.fixture
def prompt_exact():
    _, compressed, _ = _setup()
    set_prefill_semantics(compressed, PROMPT_EXACT)
    yield compressed
    set_prefill_semantics(compressed, DECODE_CONSISTENT)


def test_prefill_equals_teacher_forced_decode(decode_consistent):
    ids = _ids()
    decode = _logits_in_chunks(decode_consistent, ids, 1)
    whole = _logits_in_chunks(decode_consistent, ids, LEN)
    chunked = _logits_in_chunks(decode_consistent, ids, 7)
    assert torch.allclose(whole, decode, atol=1e-4) and torch.allclose(chunked, decode, atol=1e-4)
    assert torch.equal(whole.argmax(-1), decode.argmax(-1))


def test_prompt_exact_prefill_differs_from_decode(prompt_exact):
    """The test above can fail: prompt-exact reads the prompt in full precision."""
    ids = _ids()
    assert not torch.allclose(_logits_in_chunks(prompt_exact, ids, LEN), _logits_in_chunks(prompt_exact, ids, 1),
                              atol=1e-3)


def test_eval_simulates_what_the_cache_computes(decode_consistent):
    model, _, quantizers = _setup()
    ids = _ids()
    starts = cache_starts(LEN, prefill=30, chunk=5, semantics=DECODE_CONSISTENT)
    sim = simulated_logits(model, quantizers, ids, starts)
    assert torch.allclose(sim, _logits_in_chunks(decode_consistent, ids, LEN), atol=1e-4)


def test_the_triton_kernel_computes_the_same_prefill(decode_consistent, monkeypatch):
    """generate()'s path through the Triton kernel (the default on CUDA; Triton's interpreter here):
    whole and chunked prompts give the reference's logits (1e-4, float summation order)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not set")
    from oscar_compile.cache import decode_consistent as dc

    ids = _ids()
    want = _logits_in_chunks(decode_consistent, ids, LEN)
    choose = dc.decode_consistent_attention
    monkeypatch.setattr(dc, "decode_consistent_attention", lambda device, use_triton=None: choose(device, True))
    assert dc.decode_consistent_attention("cpu") is dc.triton_decode_consistent_attention
    whole = _logits_in_chunks(decode_consistent, ids, LEN)
    chunked = _logits_in_chunks(decode_consistent, ids, 7)
    assert torch.allclose(whole, want, atol=1e-4) and torch.allclose(chunked, want, atol=1e-4)


def test_refused_on_unrewritten_models_and_unknown_names():
    with pytest.raises(ValueError, match="rewritten"):
        set_prefill_semantics(tiny_model("qwen3", **MODEL), DECODE_CONSISTENT)
    with pytest.raises(ValueError, match="prefill semantics"):
        set_prefill_semantics(_setup()[1], "decode")
