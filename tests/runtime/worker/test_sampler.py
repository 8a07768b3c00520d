"""Sampling, sampling-parameter validation and incremental detokenization."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams
from oscar_compile.runtime.detokenizer import IncrementalDetokenizer
from oscar_compile.runtime.worker.sampler import Sampler, exponential_noise, filtered_probs, noise_key

GREEDY = SamplingParams(temperature=0.0)


def logits(batch: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax():
    x = logits()
    for params in (GREEDY, SamplingParams(top_k=1, seed=1), SamplingParams(top_p=1e-6, seed=2)):
        out = Sampler()(x, [params] * 4, list(range(4)), [9] * 4)
        assert out.token_ids == x.argmax(-1).tolist()


def test_the_draw_depends_on_seed_and_position_only():
    """Row index, batch size, neighbours and earlier calls change nothing; seed or position does."""
    x = logits(batch=3) / 3  # a flat distribution, so the draws differ
    seeded = SamplingParams(temperature=1.0)

    def stream(seed: int, sampler: Sampler, rows=slice(1, 2), row=0, n=24) -> list[int]:
        mates = [SamplingParams(), seeded, GREEDY][rows]
        return [sampler(x[rows], mates, [3, seed, 5][rows], [pos] * len(mates)).token_ids[row]
                for pos in range(100, 100 + n)]

    alone = stream(1234, Sampler())
    assert stream(1234, Sampler()) == alone
    assert stream(1234, Sampler(), rows=slice(0, 3), row=1) == alone  # in a batch, another row
    assert len(set(alone)) > 4 and stream(1235, Sampler()) != alone
    # the same (seed, position) twice in one batch: the same noise, whatever the row
    twice = Sampler()(x[[1, 1]], [seeded] * 2, [7, 7], [42, 42]).token_ids
    assert twice[0] == twice[1]


def test_noise_is_a_pure_function_of_key_and_token():
    keys = torch.tensor([noise_key(s, p) for s, p in [(0, 0), (0, 1), (1, 0), (-1, 7), (2**64 - 1, 7)]])
    noise = exponential_noise(keys, 300)
    assert torch.equal(noise[3], noise[4])  # seeds are taken mod 2^64
    assert torch.equal(exponential_noise(keys[[2, 0]], 300), noise[[2, 0]])
    assert torch.equal(exponential_noise(keys, 100), noise[:, :100])  # the vocab size is no input either
    assert len({tuple(row.tolist()) for row in noise[:3]}) == 3
    assert noise.isfinite().all() and (noise > 0).all()


def test_the_noise_is_exponential():
    """Exp(1): mean 1, variance 1 and P(E > t) = exp(-t). Over 64 x 4096 = 262,144 draws the
    standard error of the mean is 0.002 and of each tail frequency below 0.001: 5 sigma bounds."""
    keys = torch.tensor([noise_key(3, p) for p in range(64)])
    noise = exponential_noise(keys, 4096).double().flatten()
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    for t in (0.1, 1.0, 3.0):
        assert abs((noise > t).double().mean().item() - math.exp(-t)) < 0.005
    # neighbouring tokens and neighbouring positions are uncorrelated: |r| ~ 1/sqrt(N) = 0.002
    grid = noise.view(64, 4096)
    assert abs(torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([grid[:-1].flatten(), grid[1:].flatten()]))[0, 1]) < 0.01


def test_sampling_follows_the_filtered_distribution():
    """One request over 4000 positions (the stream a real request draws) matches the filtered
    distribution: a chi-square test, and each frequency within 4 standard errors (< 0.008)."""
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    expected = filtered_probs(x, [params])[0]
    assert expected[4:].sum() == 0  # top-k
    assert expected[3] == 0  # top-p: mass before token 3 is already >= 0.9
    num_draws = 4000
    tokens = Sampler()(x.expand(num_draws, -1), [params] * num_draws, [11] * num_draws,
                       list(range(num_draws))).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=6).double()
    assert torch.allclose(counts / num_draws, expected.double(), atol=0.035)
    kept = expected > 0
    chi2 = (((counts[kept] - num_draws * expected[kept]) ** 2) / (num_draws * expected[kept])).sum().item()
    assert chi2 < 13.8  # 2 degrees of freedom: p = 0.001


def test_logprobs_are_the_model_distribution():
    x = logits(batch=2)
    out = Sampler()(x, [SamplingParams(temperature=0.5, logprobs=3, seed=0), GREEDY], [0, 1], [4, 4])
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
