"""Decode-consistent prefill in the engine (CPU reference path): what is served equals what
``generate()`` computes under the same semantics, and equals itself however it was computed.

S0 = 4, W = 8, P = 4 and a step budget of 16 tokens, as tests/runtime/worker/test_exact_prefill.py. The
reference is ``generate()`` on the same rewritten model with ``set_prefill_semantics``: greedy
tokens equal, chosen-token logprobs within 1e-3 (float32; float summation order only). It is the
default semantics; the tests ask for it by name all the same. Under prompt-exact the recomputed
sequences of the tiny-swap-space case differ from generate() (that file's
test_tiny_swap_space_falls_back_to_recompute); here they may not.
"""

import copy

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT
from oscar_compile.passes.apply import set_prefill_semantics
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.core.sequence import SequenceStatus
from oscar_compile.runtime.engine_config import EngineConfig

SPEC = CompressionSpec.from_dict(
    {
        "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
        "key": {"center": True},
        "value": {"granularity": "per_head"},
    }
)
BUDGET, NEW = 16, 24
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def setup(tokenizer, tiny_model):
    rot = calibrate(
        tiny_model, SPEC, [torch.randint(0, len(tokenizer), (2, 48), generator=torch.Generator().manual_seed(0))]
    )
    ref = copy.deepcopy(tiny_model)
    apply(ref, SPEC, rot)
    set_prefill_semantics(ref, DECODE_CONSISTENT)
    cache = {}

    def expected(prompt):
        """(greedy tokens, their logprobs) of generate() under decode-consistent prefill."""
        key = tuple(prompt)
        if key not in cache:
            out = ref.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            logits = torch.stack(out.logits, dim=1)[0].float().log_softmax(-1)
            cache[key] = tokens, [logits[i, t].item() for i, t in enumerate(tokens)]
        return cache[key]

    return tokenizer, tiny_model, rot, expected, ref


def _prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _llm(setup, **kwargs):
    tokenizer, model, rot, *_ = setup
    config = EngineConfig(
        **{
            "num_window_pages": 64,
            "num_quant_pages": 256,
            "max_num_batched_tokens": BUDGET,
            "prefill_semantics": DECODE_CONSISTENT,
            **kwargs,
        }
    )
    return LLM(copy.deepcopy(model), spec=SPEC, rotations=rot, tokenizer=tokenizer, config=config)


def _run(llm, prompts):
    """Through the engine: (tokens, chosen-token logprobs) per prompt, and the Sequence objects."""
    engine = llm.engine
    seqs = [engine.add_request(p, PARAMS) for p in prompts]
    tokens = {s.request_id: [] for s in seqs}
    logprobs = {s.request_id: [] for s in seqs}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            logprobs[delta.request_id] += [e.logprob for e in delta.new_logprobs]
    return [(tokens[s.request_id], logprobs[s.request_id]) for s in seqs], seqs


def _assert_equal(got, want):
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-3)


@pytest.mark.parametrize("length", [15, 45, 155])  # 1, 3 and 10 chunks
def test_served_equals_generate_alone_and_chunked(setup, length):
    expected = setup[3]
    prompt = _prompts(400, [length])[0]
    llm = _llm(setup)
    (got,), _ = _run(llm, [prompt])
    _assert_equal(got, expected(prompt))
    stats = llm.engine.stats()
    assert stats["num_staged_prefills"] == 0 and llm.engine.page_manager.staging_pool.num_pages == 0


def test_together_resent_and_recomputed_equal_generate(setup):
    """Eight requests at once under a page budget that preempts, with a 10 kB swap space that
    fills up: some victims are recomputed (generated tokens included), then all are sent again
    to the same engine (prefix hits, at the sink)."""
    expected = setup[3]
    prompts = _prompts(400, [15, 45, 30, 60, 9, 70, 22, 38], seed=3)
    llm = _llm(setup, num_quant_pages=40, swap_space_gb=1e-5)
    scheduler = llm.engine.scheduler
    preempt, recomputed = scheduler._preempt, []

    def record(seq, out):  # which victims are recomputed, and whether they had generated tokens
        preempt(seq, out)
        if seq.status is SequenceStatus.WAITING:  # not swapped: its pages were freed
            recomputed.append(seq.num_output_tokens)

    scheduler._preempt = record
    results, seqs = _run(llm, prompts)
    assert any(n > 0 for n in recomputed), recomputed  # a recompute of generated tokens happened
    for prompt, got in zip(prompts, results, strict=True):
        _assert_equal(got, expected(prompt))
    again, _ = _run(llm, prompts)
    assert llm.engine.page_manager.num_prefix_hit_tokens > 0
    for prompt, got in zip(prompts, again, strict=True):
        _assert_equal(got, expected(prompt))


def test_generate_on_the_served_model_follows_the_engine(setup):
    """LLM(...) sets the semantics on the model it serves: generate() there reads as the engine."""
    expected = setup[3]
    prompt = _prompts(400, [45], seed=4)[0]
    llm = _llm(setup)
    out = llm.engine.runner.model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
    )
    assert out[0, len(prompt) :].tolist() == expected(prompt)[0]


def test_prompt_exact_differs(setup):
    """The tests above can fail: prompt-exact gives other tokens on a 10-chunk prompt."""
    expected = setup[3]
    prompt = _prompts(400, [155])[0]
    llm = _llm(setup, prefill_semantics="prompt-exact")
    (got,), _ = _run(llm, [prompt])
    assert got[0] != expected(prompt)[0]


def test_refusals():
    with pytest.raises(NotImplementedError, match="snapshots"):
        EngineConfig(prefill_semantics=DECODE_CONSISTENT, prefix_hits="history")
    assert EngineConfig(prefill_semantics=DECODE_CONSISTENT).prefix_hits == "snapshot"
    assert EngineConfig().prefix_hits == "snapshot"  # the default semantics is decode-consistent
    assert EngineConfig(prefill_semantics=PROMPT_EXACT).prefix_hits == "history"
    with pytest.raises(NotImplementedError, match="needs decode-consistent"):
        EngineConfig(prefill_semantics=PROMPT_EXACT, prefix_hits="snapshot")
    with pytest.raises(ValueError, match="prefill semantics"):
        EngineConfig(prefill_semantics="exact")


def test_prompt_logprobs_equal_teacher_forced_decode_steps(setup):
    """A 3-chunk prompt's prompt logprobs equal the ones decode steps give at the same positions
    (generate()'s model fed one token per forward)."""
    ref = setup[4]
    prompt = _prompts(400, [45], seed=5)[0]
    (request,) = _llm(setup).generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    cache, rows = None, []
    for token in prompt[:-1]:
        res = ref(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = getattr(res, "cache", None) or res.past_key_values
        rows.append(res.logits[0, -1].float().log_softmax(-1))
    want = [rows[p][prompt[p + 1]].item() for p in range(len(prompt) - 1)]
    assert [e.logprob for e in request.prompt_logprobs[1:]] == pytest.approx(want, abs=1e-4)


def test_a_runner_without_it_is_refused(setup):
    from oscar_compile.runtime.engine_config import build_engine
    from oscar_compile.runtime.worker.runner import RecomputeRunner

    tokenizer, model, *_ = setup
    layout = _llm(setup).engine.page_manager.layout
    config = EngineConfig(prefill_semantics=DECODE_CONSISTENT, layout=layout, num_window_pages=8, num_quant_pages=8)
    with pytest.raises(NotImplementedError, match="RecomputeRunner does not run decode-consistent"):
        build_engine(model, tokenizer, config, runner=RecomputeRunner(model))


# ---- exact prefix hits at window snapshots (runtime/core/window_snapshots.py) ----------------
SINK_AND_WINDOW = 4 + 8  # S0 + W: a hit past this resumes with history pages and a restored ring


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_resent_prompt_resumes_at_its_snapshot(setup, deterministic):
    """The resend resumes at the snapshot taken at its prompt's last page boundary (44 of 45
    tokens; inside the last chunk, [32, 45)) and computes one token: what the prompt gives alone
    on a fresh engine. In deterministic mode the boundary leaves 2 prompt tokens
    (PageManager.make_deterministic: a one-token call runs the decode kernels), so it is 40, and
    the resend equals the miss bitwise. In the default mode a row's rounding depends on its chunk
    (the miss computes position 44 in a 13-token chunk, the resend alone): the same tokens, the
    logprobs a float rounding apart."""
    expected = setup[3]
    prompt = _prompts(400, [45], seed=6)[0]
    (alone,), _ = _run(_llm(setup, deterministic=deterministic), [prompt])
    llm = _llm(setup, deterministic=deterministic)
    (first,), _ = _run(llm, [prompt])
    (again,), (seq,) = _run(llm, [prompt])
    assert seq.num_cached_prompt_tokens == (40 if deterministic else 44) > SINK_AND_WINDOW
    assert llm.engine.stats()["window_snapshot_hits"] == 1
    assert first == alone
    if deterministic:
        assert again == first
    else:
        assert again[0] == first[0] and again[1] == pytest.approx(first[1], abs=1e-5)
    _assert_equal(again, expected(prompt))


def test_a_shared_prefix_resumes_at_the_last_snapshot_within_it(setup):
    """Two prompts share 60 tokens; with snapshots every 16 tokens the second resumes at 48 (its
    history [4, 40) shared, its ring restored) and equals itself alone."""
    expected = setup[3]
    prefix, first_tail, second_tail = _prompts(400, [60, 10, 15], seed=8)
    second = prefix + second_tail
    (alone,), _ = _run(_llm(setup, snapshot_interval=16), [second])
    llm = _llm(setup, snapshot_interval=16)
    _run(llm, [prefix + first_tail])
    (got,), (seq,) = _run(llm, [second])
    assert seq.num_cached_prompt_tokens == 48
    assert got == alone
    _assert_equal(got, expected(second))


def test_a_recomputed_sequence_resumes_at_its_own_snapshot(setup):
    """No swap space and few history pages: preempted sequences are recomputed, and resume at a
    snapshot of their own (generated tokens included) past the sink and window."""
    expected = setup[3]
    prompts = _prompts(400, [45, 60, 38, 70], seed=7)
    llm = _llm(setup, num_quant_pages=24, swap_space_gb=0, snapshot_interval=16)
    page_manager = llm.engine.page_manager
    allocate, resumed = page_manager.allocate, []

    def record(seq, match, *args):
        if seq.num_preemptions:
            resumed.append(match.num_tokens)
        return allocate(seq, match, *args)

    page_manager.allocate = record
    results, _ = _run(llm, prompts)
    assert any(n > SINK_AND_WINDOW for n in resumed), resumed
    for prompt, got in zip(prompts, results, strict=True):
        _assert_equal(got, expected(prompt))


def test_snapshots_follow_the_config(setup):
    """Snapshots exist under decode-consistent prefill with prefix caching and a ring; their
    interval is whole pages (the tiny layout's P is 4)."""
    snapshots = _llm(setup, snapshot_interval=8).engine.page_manager.snapshots
    assert snapshots is not None and snapshots.interval == 8 and snapshots.num_pages == 2  # W / P
    assert _llm(setup, enable_prefix_caching=False).engine.page_manager.snapshots is None
    assert _llm(setup, prefix_hits="sink").engine.page_manager.snapshots is None
    with pytest.raises(ValueError, match="multiple of the page size"):
        _llm(setup, snapshot_interval=6)
    with pytest.raises(ValueError, match="snapshot_interval"):
        EngineConfig(prefill_semantics=DECODE_CONSISTENT, snapshot_interval=0)


def test_snapshots_taken_inside_chunks_equal_those_at_cuts(setup):
    """Snapshots every 8 tokens of a 45-token prompt, in deterministic mode (batch-invariant
    linears: a token's keys and values do not depend on its chunk, so the snapshots can be compared
    bitwise across chunkings): with a budget of 16 the chunks follow the budget (16, 16, 13) and
    the snapshots at 8, 24 and 40 (the prompt's last boundary that leaves 2 tokens) are taken inside
    them; with a budget of 4 every boundary ends a chunk. Each snapshot's pages hold the same bits
    in every layer, and both engines serve what generate() gives."""
    expected = setup[3]
    prompt = _prompts(400, [45], seed=9)[0]
    contents = {}
    for budget in (16, 4):
        llm = _llm(setup, snapshot_interval=8, max_num_batched_tokens=budget, deterministic=True)
        scheduler, chunks = llm.engine.scheduler, []
        schedule = scheduler.schedule

        def recorded(schedule=schedule, chunks=chunks):
            out = schedule()
            rows = zip(out.seqs, out.num_new_tokens, strict=True)
            chunks += [n for s, n in rows if s.num_cached_tokens < len(prompt)]
            return out

        scheduler.schedule = recorded
        (got,), (seq,) = _run(llm, [prompt])
        _assert_equal(got, expected(prompt))
        assert chunks == ([16, 16, 13] if budget == 16 else [4] * 10 + [3, 2])
        snapshots, pools = llm.engine.page_manager.snapshots, llm.engine.runner.pools
        pages = {R: snapshots.lookup(seq.block_hashes[R // 4 - 1]) for R in (8, 16, 24, 32, 40)}
        assert all(p is not None for p in pages.values()), pages
        contents[budget] = {R: [pool[list(p)].clone() for layer in pools for pool in layer[:2]]
                            for R, p in pages.items()}
    for R, want in contents[4].items():
        assert all(torch.equal(a, b) for a, b in zip(contents[16][R], want, strict=True)), R
