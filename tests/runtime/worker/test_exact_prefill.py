"""What is served is what was evaluated: INT2 greedy output equals generate() however the
prompt is chunked (deferred demotion into staging pages), and under preemption by swapping.

S0 = 4, W = 8, P = 4 and a step budget of 16 tokens: a prompt of 15 tokens runs in 1 chunk, 45 in
3, 155 in 10. generate() prefills each prompt at once. Without staging (``num_staging_pages=0``,
the old chunked prefill) later chunks read earlier ones back quantized and the outputs differ:
the first test shows it, so the others can fail.

All of it is the prompt-exact prefill semantics (formats/prefill.py), asked for explicitly in the
engine and in generate(): the default, decode-consistent, stages nothing
(test_decode_consistent_prefill.py).
"""
import copy

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.formats.prefill import PROMPT_EXACT
from oscar_compile.passes.apply import set_prefill_semantics
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.core.sequence import FinishReason
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.runtime.server.metrics import render_metrics

SPEC = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"center": True}, "value": {"granularity": "per_head"},
})
BUDGET = 16
NEW = 24
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tokenizer, tiny_model):
    rot = calibrate(tiny_model, SPEC, [torch.randint(0, len(tokenizer), (2, 48),
                                                     generator=torch.Generator().manual_seed(0))])
    ref = copy.deepcopy(tiny_model)
    apply(ref, SPEC, rot)
    set_prefill_semantics(ref, PROMPT_EXACT)
    cache = {}

    def expected(prompt):
        key = tuple(prompt)
        if key not in cache:
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return tokenizer, tiny_model, rot, expected


def _prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _llm(setup, **kwargs):
    tokenizer, model, rot, _ = setup
    config = EngineConfig(**{"num_window_pages": 64, "num_quant_pages": 256, "max_num_batched_tokens": BUDGET,
                             "prefill_semantics": PROMPT_EXACT, **kwargs})
    return LLM(copy.deepcopy(model), spec=SPEC, rotations=rot, tokenizer=tokenizer, config=config)


def _run(llm, prompts):
    """Generate through the engine; (token ids per prompt, the finished Sequence objects)."""
    engine = llm.engine
    seqs = [engine.add_request(p, PARAMS) for p in prompts]
    tokens = {s.request_id: [] for s in seqs}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    return [tokens[s.request_id] for s in seqs], seqs


def _assert_all_free(llm):
    """Every device page, staging page and host swap range is free once all requests ended."""
    bm = llm.engine.page_manager
    for pool in (bm.window_pool, bm.quant_pool, bm.staging_pool):
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_pages, pool.kind
    assert bm.staging_pool.num_cached == 0  # staging pages are never registered for reuse
    assert bm.swap_space is None or bm.swap_space.is_empty()


def test_chunked_prefill_without_staging_differs(setup):
    """The old chunked prefill (staging off): a 10-chunk prompt reads its first chunks quantized."""
    *_, expected = setup
    prompt = _prompts(400, [155])[0]
    llm = _llm(setup, num_staging_pages=0)
    assert llm.generate([prompt], PARAMS)[0].outputs[0].token_ids != expected(prompt)


@pytest.mark.parametrize("length, chunks", [(15, 1), (45, 3), (155, 10)])
def test_int2_greedy_equals_generate_for_1_3_and_10_chunks(setup, length, chunks):
    *_, expected = setup
    prompt = _prompts(400, [length])[0]
    assert -(-length // BUDGET) == chunks
    llm = _llm(setup)
    tokens, seqs = _run(llm, [prompt])
    assert tokens[0] == expected(prompt)
    stats = llm.engine.stats()
    assert stats["num_staged_prefills"] == (chunks > 1)  # one chunk: generate()'s write already
    if chunks > 1:  # the whole history was staged at once: ceil((n - W - S0) / P) pages
        assert stats["staging_pages_peak"] == -(-(length - 12) // 4)
    _assert_all_free(llm)


def test_concurrent_requests_of_mixed_lengths_equal_generate(setup):
    """Six requests at once: chunks of different prompts share steps with decodes."""
    *_, expected = setup
    prompts = _prompts(400, [15, 45, 30, 60, 9, 70], seed=2)
    llm = _llm(setup)
    tokens, _ = _run(llm, prompts)
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == expected(prompt)
    assert llm.engine.stats()["num_staged_prefills"] == 4  # all but 15 and 9
    _assert_all_free(llm)


def test_tight_page_budget_swaps_several_times_and_stays_exact(setup):
    """40 history pages for eight requests: preempted sequences are swapped out and back in.
    (A victim still prefilling is recomputed instead, staged again: exact as well.)"""
    *_, expected = setup
    prompts = _prompts(400, [15, 45, 30, 60, 9, 70, 22, 38], seed=3)
    llm = _llm(setup, num_quant_pages=40, swap_space_gb=0.01)
    tokens, seqs = _run(llm, prompts)
    stats = llm.engine.stats()
    assert stats["num_swap_preemptions"] >= 3 and stats["num_swap_ins"] == stats["num_swap_preemptions"]
    assert sum(s.num_swaps > 0 for s in seqs) >= 2
    text = render_metrics(stats)  # /metrics counts both kinds of preemption and the staging pages
    assert f"\noscar_swap_preemptions_total {float(stats['num_swap_preemptions'])}\n" in text
    assert f"\noscar_recompute_preemptions_total {float(stats['num_recompute_preemptions'])}\n" in text
    assert '\noscar_kv_pages_used{kind="staging"} 0.0\n' in text and "\noscar_staging_pages_peak " in text
    for prompt, got in zip(prompts, tokens, strict=True):
        assert got == expected(prompt)
    _assert_all_free(llm)


def test_tiny_swap_space_falls_back_to_recompute(setup):
    """The same requests with a swap space of 10 kB (a sequence's 3 window pages take 6 kB, its
    history pages 1.1 kB each): it fills up, and victims that find no room are recomputed. Their
    outputs may differ from generate() (recomputed tokens attend to each other in full precision
    where the decoded ones had read their history quantized); every other request stays exact.
    Requests 4 and 6 swap (4 twice); 3 is recomputed for want of room (with 20 kB it swaps), 5
    and 7 were still prefilling (staged victims are always recomputed, staged again)."""
    *_, expected = setup
    prompts = _prompts(400, [15, 45, 30, 60, 9, 70, 22, 38], seed=3)
    llm = _llm(setup, num_quant_pages=40, swap_space_gb=1e-5)
    tokens, seqs = _run(llm, prompts)
    stats = llm.engine.stats()
    recomputed = [i for i, s in enumerate(seqs) if s.num_preemptions > s.num_swaps]
    swapped = [i for i, s in enumerate(seqs) if s.num_swaps]
    assert recomputed == [3, 5, 7] and swapped == [4, 6]  # (deterministic scheduling)
    assert stats["num_recompute_preemptions"] == 4 and stats["num_swap_preemptions"] == 3
    for i, (prompt, got) in enumerate(zip(prompts, tokens, strict=True)):
        if i not in recomputed:
            assert got == expected(prompt), i
    assert all(seqs[i].finish_reason is FinishReason.LENGTH for i in range(len(seqs)))
    _assert_all_free(llm)


def test_a_prompt_too_long_to_stage_is_refused(setup):
    """Prompts longer than a step are staged; one whose history the staging pool cannot hold
    is refused with a clear error, not served at lower precision."""
    from oscar_compile.runtime.core.sampling_params import RequestError

    llm = _llm(setup, num_staging_pages=5)  # 20 history rows: prompts of up to 32 tokens
    prompt = _prompts(400, [45])[0]
    with pytest.raises(RequestError, match="prefill staging memory"):
        llm.generate([prompt], PARAMS)
    assert llm.generate([prompt[:32]], PARAMS)[0].outputs[0].token_ids == setup[3](prompt[:32])
    _assert_all_free(llm)


def test_prefix_hits_at_the_sink_only_equal_generate(setup):
    """``prefix_hits="sink"``: a prompt sharing 40 tokens with an earlier one reuses the sink page
    only and prefills the rest staged: the output of a miss, i.e. of generate()."""
    *_, expected = setup
    shared = _prompts(400, [40], seed=7)[0]
    first, second = [shared + tail for tail in _prompts(400, [6, 21], seed=8)]
    llm = _llm(setup, prefix_hits="sink")
    assert llm.generate([first], PARAMS)[0].outputs[0].token_ids == expected(first)
    assert llm.generate([second], PARAMS)[0].outputs[0].token_ids == expected(second)
    bm = llm.engine.page_manager
    assert bm.num_prefix_hit_tokens == SPEC.kv_cache.sink_tokens and bm.num_staged_prefills == 2
    _assert_all_free(llm)
