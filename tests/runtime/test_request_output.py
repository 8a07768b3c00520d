"""``LLM.generate``'s shape is vLLM's: one ``RequestOutput`` per prompt, in order, with its ``n``
choices in ``outputs`` (tiny random Qwen3, the exact RecomputeRunner, CPU)."""

from __future__ import annotations

import random

import pytest

from oscar_compile.runtime import LLM, CompletionOutput, RequestOutput, SamplingParams

PROMPT_LEN = 40


@pytest.fixture(scope="module")
def llm(tiny_model, tokenizer):
    return LLM(tiny_model, tokenizer=tokenizer)


@pytest.fixture
def ids(tokenizer):
    rng = random.Random(7)
    return [rng.randrange(3, len(tokenizer)) for _ in range(PROMPT_LEN)]


def test_one_request_output_per_prompt_with_its_n_choices(llm, tokenizer, ids):
    text = "The quick brown fox"
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]
    outs = llm.generate([text, ids], params)
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    first, second = outs
    assert first.prompt == text and first.prompt_token_ids == tokenizer.encode(text)
    assert second.prompt is None and second.prompt_token_ids == ids  # token ids given: no prompt string
    assert first.request_id != second.request_id
    assert first.finished and second.finished and first.prompt_logprobs is None
    assert all(type(c) is CompletionOutput for o in outs for c in o.outputs)
    assert [(c.index, c.seed) for c in first.outputs] == [(0, 11), (1, 12), (2, 13)]
    assert [c.index for c in second.outputs] == [0]
    for choice in first.outputs:
        assert len(choice.token_ids) == 5 and choice.finish_reason == "length" and choice.error is None
        assert choice.text == tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3  # seeds 11, 12, 13 draw differently
    # choice i is what a request of one seeded 11 + i draws
    alone = llm.generate([text] * 3, [SamplingParams(max_tokens=5, temperature=1.0, seed=11 + i, ignore_eos=True)
                                      for i in range(3)])
    assert [c.token_ids for c in first.outputs] == [o.outputs[0].token_ids for o in alone]


def test_a_single_prompt_gives_a_list_of_one(llm, ids):
    for prompt in ("hello", ids):
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
        assert out.prompt == (prompt if isinstance(prompt, str) else None)


def test_num_cached_tokens_counts_a_resend_s_prefix_hit(llm, tokenizer):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    rng = random.Random(8)
    prompt = [rng.randrange(3, len(tokenizer)) for _ in range(PROMPT_LEN)]  # one this engine has not seen
    (miss,) = llm.generate([prompt], params)
    (hit,) = llm.generate([prompt], params)
    assert miss.num_cached_tokens == 0
    assert 0 < hit.num_cached_tokens < len(prompt)  # whole pages, the last token recomputed
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids


def test_logprobs_and_their_sum_only_when_asked(llm, ids):
    (plain,) = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None
    asked = SamplingParams(max_tokens=4, temperature=1.0, seed=3, n=2, logprobs=1, prompt_logprobs=0,
                           ignore_eos=True)
    (out,) = llm.generate([ids], asked)
    for choice in out.outputs:
        assert [lp.token_id for lp in choice.logprobs] == choice.token_ids
        assert choice.cumulative_logprob == sum(lp.logprob for lp in choice.logprobs) < 0
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None  # on the request, once
