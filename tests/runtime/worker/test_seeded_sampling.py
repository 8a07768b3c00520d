"""Sampling at temperature > 0 draws with noise keyed on (the request's seed, the token's
position) only (worker/sampler.py): a request gives the same tokens alone, in any row of any
batch, and after its pages were swapped out or dropped and recomputed; an unseeded request is
reproduced by the seed it was assigned.

The compressed runner in BF16 mode on the CPU, with real pages: its logits do not depend on how
a prompt is chunked or batched (test_overlap.py), so every difference would be the sampler's.
"""
from __future__ import annotations

import copy
import random

import pytest

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.runtime.core.sampling_params import SamplingParams, default_seed
from oscar_compile.runtime.engine_config import EngineConfig, build_engine
from oscar_compile.runtime.llm import LLM
from oscar_compile.runtime.worker.compressed_runner import compressed_layout, runner_factory

BF16 = CompressionSpec.from_dict({"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"},
                                  "value": {"rotation": "none"}})
ROOMY = dict(num_window_pages=64, num_quant_pages=128, max_num_batched_tokens=512)
TIGHT = dict(num_window_pages=1, num_quant_pages=16, max_num_batched_tokens=16)  # preempts


@pytest.fixture(scope="module")
def compressed(tiny_model):
    model = copy.deepcopy(tiny_model)
    return apply(model, BF16, calibrate(model, BF16))  # no rotation: no data needed


def _engine(compressed, tokenizer, **config):
    layout = compressed_layout(compressed.model, BF16)
    cfg = EngineConfig(layout=layout, **{**ROOMY, **config})
    return build_engine(compressed.model, tokenizer, cfg, make_runner=runner_factory(compressed, layout, cfg))


def _run(engine, requests, request_ids=None):
    ids = request_ids or [None] * len(requests)
    seqs = [engine.add_request(list(p), params, rid) for (p, params), rid in zip(requests, ids, strict=True)]
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs], seqs


def _prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(4, 24))] for _ in range(count)]


def _sampled(seed: int | None, max_tokens: int = 20, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, **kwargs)


def test_a_seeded_request_gives_its_tokens_alone_and_in_any_row(compressed, tokenizer):
    prompts = _prompts(tokenizer, 5)
    target = (prompts[0], _sampled(42, top_p=0.95))
    alone = _run(_engine(compressed, tokenizer), [target])[0][0]
    others = [(prompts[1], _sampled(None)), (prompts[2], SamplingParams(max_tokens=7, temperature=0.0)),
              (prompts[3], _sampled(7, max_tokens=12)), (prompts[4], _sampled(None, top_k=5))]
    for order in ([target, *others], [*others[:2], target, *others[2:]], [*others, target]):
        got, _ = _run(_engine(compressed, tokenizer, overlap_steps=False), order)
        assert got[order.index(target)] == alone
    assert len(set(alone)) > 5  # really sampled, not a greedy-like flat run
    assert _run(_engine(compressed, tokenizer), [(prompts[0], _sampled(43, top_p=0.95))])[0][0] != alone


@pytest.mark.parametrize("swap_space_gb, kind", [(4.0, "swap"), (0.0, "recompute")])
def test_preempted_requests_resume_with_the_same_draws(compressed, tokenizer, swap_space_gb, kind):
    """Six sampled requests (four seeded, two not) on a pool too small for them: preempted by
    swapping out or by dropping their pages, they end with the tokens of a pool that never
    preempts, and the seeded ones with their tokens alone."""
    prompts = _prompts(tokenizer, 6, seed=1)
    requests = [(p, _sampled(seed=[11, None, 12, 13, None, 14][i], max_tokens=18)) for i, p in enumerate(prompts)]
    request_ids = [f"r{i}" for i in range(6)]  # the unseeded ones get the same default seed in both
    roomy = _engine(compressed, tokenizer)
    want, _ = _run(roomy, requests, request_ids)
    tight = _engine(compressed, tokenizer, swap_space_gb=swap_space_gb, **TIGHT)
    got, seqs = _run(tight, requests, request_ids)
    stats = tight.stats()
    assert stats[f"num_{kind}_preemptions"] > 0 and roomy.scheduler.num_preemptions == 0
    assert sum(s.num_preemptions > 0 for s in seqs) >= 2
    assert got == want
    for i in (0, 2):
        assert _run(_engine(compressed, tokenizer), [requests[i]])[0][0] == want[i]


def test_an_unseeded_request_is_reproduced_by_its_assigned_seed(compressed, tokenizer):
    prompt = _prompts(tokenizer, 1, seed=2)[0]
    engine = _engine(compressed, tokenizer, seed=5)
    (first, second), seqs = _run(engine, [(prompt, _sampled(None)), (prompt, _sampled(None))], ["a", "b"])
    assert first != second  # two requests without a seed draw differently
    assert [s.seed for s in seqs] == [default_seed(5, "a"), default_seed(5, "b")]
    assert _run(_engine(compressed, tokenizer), [(prompt, _sampled(seqs[0].seed))])[0][0] == first
    assert _run(_engine(compressed, tokenizer, seed=5), [(prompt, _sampled(None))], ["a"])[0][0] == first
    assert _run(_engine(compressed, tokenizer, seed=6), [(prompt, _sampled(None))], ["a"])[0][0] != first


def test_generate_reports_the_seed_that_reproduces_its_output(tiny_model, tokenizer):
    llm = LLM(tiny_model, tokenizer=tokenizer)
    first = llm.generate("The quick brown fox", _sampled(None, max_tokens=12))[0].outputs[0]
    again = llm.generate("The quick brown fox", _sampled(first.seed, max_tokens=12))[0].outputs[0]
    assert again.seed == first.seed and again.token_ids == first.token_ids
    greedy = llm.generate("The quick brown fox", SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    assert greedy.token_ids != first.token_ids  # really sampled


def test_default_seeds_are_stable_and_distinct():
    assert default_seed(0, "cmpl-1") == default_seed(0, "cmpl-1")  # no salted hash(): stable across runs
    seeds = {default_seed(base, rid) for base in (0, 1, -1) for rid in ("0", "1", "cmpl-1")}
    assert len(seeds) == 9 and all(0 <= s < 2**64 for s in seeds)
