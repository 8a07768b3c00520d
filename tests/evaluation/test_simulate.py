"""The simulated cache (one forward, fake-quantized copies and masks) against the real one.

The real path is ``apply()`` + the OscarCache behind HF ``generate()`` (and a chunked prefill on top
of a cached prefix, the needle task's schedule). The simulation runs on an unmodified copy of the
model. float32 tiny models: the two differ only by float rounding order, so logits agree to 1e-4
and the greedy tokens are identical. The comparisons run in both prefill semantics, the cache's
(``set_prefill_semantics``) and the simulation's (``cache_starts``) set alike.
"""
import functools

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.evaluation.quantizers import cache_starts, spec_quantizers
from oscar_compile.evaluation.simulate import simulated_logits
from oscar_compile.formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT
from oscar_compile.passes.apply import set_prefill_semantics
from oscar_compile.testing import tiny_model

SINK, RECENT, VOCAB = 4, 8, 64
MODEL = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=VOCAB, seed=3)


def _spec(bits=2, center=True):
    return CompressionSpec.from_dict({
        "kv_cache": {"bits": bits, "group_size": 16, "sink_tokens": SINK, "recent_tokens": RECENT, "page_size": 4},
        "key": {"rotation": "oscar", "center": center, "clip_ratio": 0.9},
        "value": {"rotation": "oscar", "granularity": "per_head", "clip_ratio": 0.85},
    })


@functools.cache
def _setup(bits, center):
    model = tiny_model("qwen3", **MODEL)
    spec = _spec(bits, center)
    rot = calibrate(model, spec, [torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))])
    compressed = tiny_model("qwen3", **MODEL)
    apply(compressed, spec, rot)
    layers = [spec.for_layer(i, 2) for i in range(2)]
    return model, compressed, spec_quantizers(layers, rot, 32, torch.device("cpu"))


def _with_semantics(setup, semantics):
    """``setup`` with its compressed model reading prompts under ``semantics``."""
    set_prefill_semantics(setup[1], semantics)
    return setup


@pytest.fixture(params=[DECODE_CONSISTENT, PROMPT_EXACT])
def semantics(request):
    yield request.param
    for bits, center in ((2, True), (4, False)):  # back to the default apply() set
        set_prefill_semantics(_setup(bits, center)[1], DECODE_CONSISTENT)


@pytest.mark.parametrize("bits, center, prompt_len", [(2, True, SINK + RECENT + 9), (4, False, 6)])
def test_simulation_equals_apply_and_generate(bits, center, prompt_len, semantics):
    model, compressed, quantizers = _with_semantics(_setup(bits, center), semantics)
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
    num_new = 2 * (SINK + RECENT)  # decoded tokens themselves get demoted to the history
    out = compressed.generate(prompt, max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
    seq = out.sequences
    real = torch.stack(out.logits, dim=1)  # [1, num_new, V]: step i predicts token prompt_len + i
    starts = cache_starts(seq.shape[1] - 1, prefill=prompt_len, semantics=semantics)
    sim = simulated_logits(model, quantizers, seq[:, :-1], starts)[:, prompt_len - 1:]
    assert torch.equal(sim.argmax(-1), seq[:, prompt_len:])
    assert torch.allclose(sim, real, atol=1e-4)


def test_chunk_on_a_cached_prefix_equals_the_real_cache(semantics):
    """Prefill, then a multi-token chunk that reads the quantized history, then decode steps."""
    model, compressed, quantizers = _with_semantics(_setup(2, True), semantics)
    g = torch.Generator().manual_seed(7)
    prefix, chunk, tail = (torch.randint(0, VOCAB, (1, n), generator=g) for n in (30, 5, 3))
    first = compressed(input_ids=prefix, use_cache=True)
    cache = getattr(first, "cache", None) or first.past_key_values
    logits = [compressed(input_ids=chunk, past_key_values=cache).logits]
    for tok in tail.split(1, dim=1):
        logits.append(compressed(input_ids=tok, past_key_values=cache).logits)
    real = torch.cat(logits, dim=1)
    seq = torch.cat([prefix, chunk, tail], dim=1)
    starts = cache_starts(seq.shape[1], prefill=30, chunk=5, semantics=semantics)
    sim = simulated_logits(model, quantizers, seq, starts)[:, 30:]
    assert torch.allclose(sim, real, atol=1e-4)


def test_short_sequences_are_the_models_own_attention():
    model, _, quantizers = _setup(2, True)
    ids = torch.randint(0, VOCAB, (2, SINK + RECENT), generator=torch.Generator().manual_seed(2))
    plain = model(ids).logits
    sim = simulated_logits(model, quantizers, ids, cache_starts(ids.shape[1]))
    assert torch.equal(sim, plain)


def test_cache_starts_schedule():
    starts = cache_starts(8, prefill=torch.tensor([3, 0]), chunk=torch.tensor([2, 0]))
    assert starts.tolist() == [[0, 0, 0, 3, 3, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]
