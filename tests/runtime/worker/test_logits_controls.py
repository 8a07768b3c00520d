"""The logit controls (penalties, logit_bias, min_tokens, min_p) against transformers' own logits
processors, or a plain-torch reference where transformers has none (presence / frequency)."""

from __future__ import annotations

import math

import pytest
import torch

from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams
from oscar_compile.runtime.core.sequence import Sequence
from oscar_compile.runtime.worker import sampler as sampler_module
from oscar_compile.runtime.worker.logits_controls import apply_controls, build_controls
from oscar_compile.runtime.worker.sampler import Sampler, filtered_probs

transformers = pytest.importorskip("transformers")
V = 40
EOS = (0,)


def make_seq(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence(prompt, SamplingParams(**{"max_tokens": 64, "temperature": 0.0, **params}))
    for token in output:
        seq.append_token(token)
    return seq


def random_logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed)) * 3


def controlled(seqs: list[Sequence], logits: torch.Tensor, **kwargs) -> torch.Tensor:
    controls = build_controls(seqs, EOS, V, logits.device, **kwargs)
    assert controls is not None
    return apply_controls(logits, controls)


PROMPTS = [[5, 6, 7, 5], [1, 2, 3], [9, 9, 10, 11, 12]]
OUTPUTS = [[7, 8, 8, 13], [], [3, 3, 3, 12]]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(penalty):
    seqs = [make_seq(p, o, repetition_penalty=penalty) for p, o in zip(PROMPTS, OUTPUTS, strict=True)]
    x = random_logits(3)
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
    for row, seq in enumerate(seqs):  # transformers reads prompt + output as its input_ids
        expected = processor(torch.tensor([seq.token_ids]), x[row:row + 1].clone())
        torch.testing.assert_close(controlled([seq], x[row:row + 1]), expected, rtol=0, atol=0)
    expected = torch.cat([processor(torch.tensor([s.token_ids]), x[r:r + 1].clone()) for r, s in enumerate(seqs)])
    torch.testing.assert_close(controlled(seqs, x), expected, rtol=0, atol=0)


def test_presence_and_frequency_penalties_count_the_output_only():
    seqs = [make_seq(p, o, presence_penalty=0.5 * r - 0.4, frequency_penalty=1.5 - r)
            for r, (p, o) in enumerate(zip(PROMPTS, OUTPUTS, strict=True))]
    x = random_logits(3, seed=1)
    expected = x.clone()
    for row, seq in enumerate(seqs):  # OpenAI: logit -= presence * (count > 0) + frequency * count
        counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64), minlength=V).float()
        expected[row] -= seq.params.presence_penalty * (counts > 0).float() + seq.params.frequency_penalty * counts
    torch.testing.assert_close(controlled(seqs, x), expected, rtol=1e-6, atol=1e-6)


def test_logit_bias_equals_transformers_sequence_bias():
    bias = {3: 100.0, 8: -100.0, 17: 2.5}
    seq = make_seq([1, 2], [4], logit_bias=bias)
    x = random_logits(1, seed=2)
    processor = transformers.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})
    expected = processor(torch.tensor([seq.token_ids]), x.clone())
    torch.testing.assert_close(controlled([seq], x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("num_output", [0, 2, 3, 5])
def test_min_tokens_equals_transformers_min_new_tokens(num_output):
    prompt = [4, 5, 6]
    seq = make_seq(prompt, list(range(10, 10 + num_output)), min_tokens=3, stop_token_ids=[7])
    x = random_logits(1, seed=3)
    processor = transformers.MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos_token_id=[0, 7])
    expected = processor(torch.tensor([seq.token_ids]), x.clone())
    torch.testing.assert_close(controlled([seq], x), expected, rtol=0, atol=0)
    # ignore_eos leaves EOS alone; the stop token ids stay masked
    quiet = make_seq(prompt, [], min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    out = controlled([quiet], x)
    assert out[0, 7] == float("-inf") and out[0, 0] == x[0, 0]


@pytest.mark.parametrize("min_p, temperature", [(0.05, 1.0), (0.2, 0.7), (0.5, 1.5)])
def test_min_p_equals_transformers(min_p, temperature):
    x = random_logits(2, seed=4)
    params = SamplingParams(temperature=temperature, min_p=min_p)
    warped = transformers.MinPLogitsWarper(min_p)(torch.zeros(2, 1, dtype=torch.int64), x / temperature)
    torch.testing.assert_close(filtered_probs(x, [params] * 2), torch.softmax(warped, -1), rtol=1e-6, atol=1e-7)


def test_the_pending_token_of_an_overlapped_step_is_counted():
    """A sequence whose last sample is still on the device: its count comes from that step's tensor."""
    x = random_logits(2, seed=5)
    seqs = [make_seq([1, 2], [3], frequency_penalty=1.0), make_seq([4], [5], frequency_penalty=1.0)]
    seqs[1].num_pending = 1
    previous_samples = torch.tensor([11, 9, 12])  # the previous step's rows; seq 1 was its row 1
    out = controlled(seqs, x, pending_tokens=previous_samples, pending_src={seqs[1].seq_id: 1})
    known = make_seq([4], [5, 9], frequency_penalty=1.0)
    torch.testing.assert_close(out[1], controlled([known], x[1:2])[0])
    torch.testing.assert_close(out[0], controlled(seqs[:1], x[:1])[0])
    # min_tokens counts the pending token too
    waiting = make_seq([4], [5], min_tokens=2)
    assert build_controls([waiting], EOS, V, x.device).banned is not None
    waiting.num_pending = 1
    assert build_controls([waiting], EOS, V, x.device).banned is None


def test_rows_without_controls_are_untouched_and_a_batch_without_any_pays_nothing(monkeypatch):
    x = random_logits(3, seed=6)
    plain = make_seq([1], [2])
    biased = make_seq([1], [2], logit_bias={5: 50.0})
    out = controlled([plain, biased, plain], x)
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2])
    assert out[1, 5] == x[1, 5] + 50 and torch.equal(out[1, :5], x[1, :5])
    assert build_controls([plain, plain], EOS, V, x.device) is None
    assert build_controls([make_seq([1], [], min_p=0.1, top_k=3)], EOS, V, x.device) is None

    def fail(*args):
        raise AssertionError("no control is used: nothing may run for them")

    monkeypatch.setattr(sampler_module, "apply_controls", fail)
    tokens = Sampler()(x, [plain.params] * 3, [0, 1, 2], [5, 5, 5], controls=None).token_ids
    assert tokens == x.argmax(-1).tolist()


def test_logprobs_stay_the_models_own():
    x = random_logits(2, seed=7)
    seqs = [make_seq([1], [2], logit_bias={4: 100.0}, logprobs=2), make_seq([1], [2], repetition_penalty=2.0,
                                                                            logprobs=0)]
    controls = build_controls(seqs, EOS, V, x.device)
    out = Sampler()(x, [s.params for s in seqs], [0, 1], [5, 5], controls)
    assert out.token_ids[0] == 4
    reference = torch.log_softmax(x, -1)
    assert math.isclose(out.logprobs[0], reference[0, 4].item(), rel_tol=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == reference[0].topk(2).indices.tolist()
    assert out.token_ids[1] == apply_controls(x, controls)[1].argmax().item()
    assert math.isclose(out.logprobs[1], reference[1, out.token_ids[1]].item(), rel_tol=1e-6)


def test_the_logits_given_are_never_changed():
    x = random_logits(2, seed=8)
    before = x.clone()
    controlled([make_seq([1], [2, 2], repetition_penalty=1.5, presence_penalty=1.0, logit_bias={1: 3.0},
                         min_tokens=1)] * 2, x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("kwargs, field", [
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"), (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"3": 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
])
def test_bad_controls_name_their_field(kwargs, field):
    with pytest.raises(RequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field


def test_the_token_cache_gives_the_counts_of_a_fresh_build_step_after_step():
    from oscar_compile.runtime.worker.logits_controls import TokenCache

    cache = TokenCache()
    seqs = [make_seq([5, 6, 5, 9], [], repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=3),
            make_seq([1, 2], [4], presence_penalty=1.0)]
    x = random_logits(2, seed=9)
    for step, token in enumerate([6, 6, 8, 3, 3, 1]):  # past max_tokens: the buffer grows
        cached = build_controls(seqs, EOS, V, x.device, cache=cache)
        fresh = build_controls(seqs, EOS, V, x.device)
        assert torch.equal(cached.output_counts, fresh.output_counts), step
        assert torch.equal(apply_controls(x, cached), apply_controls(x, fresh)), step
        for seq in seqs:
            seq.append_token(token)
    assert cache.prompt_ids(seqs[0], x.device).tolist() == [5, 6, 9]
    for seq in seqs:
        cache.forget(seq.seq_id)
    assert not cache._prompt and not cache._output
