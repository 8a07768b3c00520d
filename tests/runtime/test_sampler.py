"""Sampling, sampling-parameter validation and incremental detokenization."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams
from oscar_compile.runtime.detokenizer import IncrementalDetokenizer
from oscar_compile.runtime.worker.sampler import Sampler, filtered_probs

GREEDY = SamplingParams(temperature=0.0)


def logits(batch: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax():
    x = logits()
    for params in (GREEDY, SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=2)):
        out = Sampler()(x, [params] * 4, list(range(4)))
        assert out.token_ids == x.argmax(-1).tolist()


def test_a_seed_fixes_the_tokens_whatever_the_batch():
    x = logits(batch=3) / 3  # a flat distribution, so the draws differ
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler()(x[1:2], [seeded], [7]).token_ids[0] for _ in range(2)]
    sampler = Sampler()
    mixed = sampler(x, [SamplingParams(), seeded, GREEDY], [1, 7, 3]).token_ids[1]
    assert alone[0] == alone[1] == mixed
    # successive draws of one request follow its own stream
    stream_a = [sampler(x[1:2], [seeded], [8]).token_ids[0] for _ in range(20)]
    other = Sampler()
    stream_b = [other(x[1:2], [seeded], [9]).token_ids[0] for _ in range(20)]
    assert stream_a == stream_b and len(set(stream_a)) > 1


def test_sampling_follows_the_filtered_distribution():
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, seed=0)
    expected = filtered_probs(x, [params])[0]
    assert expected[4:].sum() == 0  # top-k
    assert expected[3] == 0  # top-p: mass before token 3 is already >= 0.9
    sampler = Sampler()
    counts = torch.zeros(6)
    num_draws = 4000
    for _ in range(num_draws):
        counts[sampler(x, [params], [0]).token_ids[0]] += 1
    # 4000 draws: the standard error of each frequency is below 0.008; allow 4 sigma
    assert torch.allclose(counts / num_draws, expected, atol=0.035)


def test_logprobs_are_the_model_distribution():
    x = logits(batch=2)
    out = Sampler()(x, [SamplingParams(temperature=0.5, logprobs=3, seed=0), GREEDY], [0, 1])
    reference = torch.log_softmax(x, -1)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert math.isclose(out.logprobs[0], reference[0, out.token_ids[0]].item(), rel_tol=1e-6)
    top_ids = [t for t, _ in out.top_logprobs[0]]
    assert top_ids == reference[0].topk(3).indices.tolist()


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=1.5), "max_tokens"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.1), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(seed="7"), "seed"), (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(ignore_eos=1), "ignore_eos"),
])
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(RequestError, match=field) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and isinstance(info.value, ValueError)


def test_a_single_stop_string_is_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_incremental_text_equals_the_full_decode(tokenizer):
    text = "hello world, héllo wörld, 你好, 🙂 The quick brown fox"
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("A paged KV cache")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for token in ids:
        assert not detok.append(token)
        pieces.append(detok.take_delta(finished=False))
        assert "\ufffd" not in pieces[-1]
    detok.flush()
    pieces.append(detok.take_delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids) == text


def test_a_stop_string_cuts_the_text_and_is_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["lazy", "zzz"])
    streamed = ""
    stopped_at = None
    for i, token in enumerate(ids):
        if detok.append(token):
            stopped_at = i
            break
        streamed += detok.take_delta(finished=False)
        assert "laz" not in streamed and not streamed.endswith("la")
    streamed += detok.take_delta(finished=True)
    assert stopped_at is not None and streamed == "The quick brown fox jumps over the "
    assert detok.matched_stop == "lazy"
