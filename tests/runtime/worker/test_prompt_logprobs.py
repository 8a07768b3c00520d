"""Prompt logprobs come from the prefill and equal the model's teacher-forced log-softmax.

Served semantics: the exact RecomputeRunner (the plain model), the compressed runner in BF16 mode
(the plain model over full-precision pages) and an INT2 spec (S0 = 4, W = 8, P = 4) in both
prefill semantics, whose prefill gives the same logits however it is chunked: decode-consistent
(the default: every prompt token reads the cache as a decode step at its position,
test_decode_consistent_prefill.py) and prompt-exact (the whole prompt in full precision,
deferred demotion, test_exact_prefill.py). The reference is the rewritten model's one-shot
forward under the same semantics, as ``generate()`` prefills. A step budget of 16 tokens
prefills a 45-token prompt in 3 chunks.
"""
import copy

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.formats.prefill import PROMPT_EXACT
from oscar_compile.passes.apply import set_prefill_semantics
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig, build_engine

INT2 = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"center": True}, "value": {"granularity": "per_head"},
})
BF16 = CompressionSpec.from_dict({"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"},
                                  "value": {"rotation": "none"}})
K = 3


@pytest.fixture(scope="module")
def rotations(tokenizer, tiny_model):
    return calibrate(tiny_model, INT2, [torch.randint(0, len(tokenizer), (2, 48),
                                                      generator=torch.Generator().manual_seed(0))])


def _prompt(vocab: int, length: int, seed: int = 1) -> list[int]:
    return torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _teacher_forced(model, prompt: list[int]) -> torch.Tensor:
    """[T - 1, V] float32: log_softmax of the logits at positions 0 .. T - 2."""
    with torch.no_grad():
        ids = torch.tensor([prompt], device=next(model.parameters()).device)
        logits = model(ids, use_cache=True).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _engine(kind: str, tiny_model, tokenizer, rotations, budget: int, **kwargs):
    """``kind``: recompute, bf16, int2 (the default prefill semantics) or int2-prompt-exact."""
    if kind == "int2-prompt-exact":
        kind, kwargs = "int2", {**kwargs, "prefill_semantics": PROMPT_EXACT}
    config = EngineConfig(num_window_pages=64, num_quant_pages=256, max_num_batched_tokens=budget, **kwargs)
    if kind == "recompute":
        return build_engine(tiny_model, tokenizer, config)
    spec = INT2 if kind == "int2" else BF16
    return LLM(copy.deepcopy(tiny_model), spec=spec, rotations=rotations if kind == "int2" else None,
               tokenizer=tokenizer, config=config).engine


def _run(engine, prompts, params):
    """Every RequestOutput per request, in order of submission."""
    seqs = [engine.add_request(p, params) for p in prompts]
    outputs = {s.request_id: [] for s in seqs}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id in outputs:  # (not a request added by the caller)
                outputs[delta.request_id].append(delta)
    return [outputs[s.request_id] for s in seqs]


def _reference(kind, tiny_model, rotations):
    if not kind.startswith("int2"):
        return tiny_model
    ref = copy.deepcopy(tiny_model)
    apply(ref, INT2, rotations)  # the default semantics, as the engine's
    if kind == "int2-prompt-exact":
        set_prefill_semantics(ref, PROMPT_EXACT)
    return ref


@pytest.mark.parametrize("kind", ["recompute", "bf16", "int2", "int2-prompt-exact"])
def test_prompt_logprobs_equal_teacher_forced_through_chunked_prefill(kind, tiny_model, tokenizer, rotations):
    prompts = [_prompt(len(tokenizer), 45, seed=1), _prompt(len(tokenizer), 20, seed=2)]
    ref = _reference(kind, tiny_model, rotations)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    got = {}
    for budget in (16, 256):  # 3 chunks (and 2) against one
        engine = _engine(kind, tiny_model, tokenizer, rotations, budget)
        results = _run(engine, prompts, params)
        got[budget] = [out[0].prompt_logprobs for out in results]
        assert all(o.prompt_logprobs is None for out in results for o in out[1:])  # with the first output only
        assert engine.stats()["prefix_cache_hit_tokens"] == 0
    for prompt, chunked, whole in zip(prompts, got[16], got[256], strict=True):
        expected = _teacher_forced(ref, prompt)
        assert len(chunked) == len(prompt) and chunked[0] is None and whole[0] is None
        for p, (a, b) in enumerate(zip(chunked[1:], whole[1:], strict=True)):
            target = prompt[p + 1]
            assert a.token_id == b.token_id == target
            assert a.logprob == pytest.approx(expected[p, target].item(), abs=1e-4)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.rank == 1 + int((expected[p] > expected[p, target]).sum())
            assert [t for t, _ in a.top] == expected[p].topk(K).indices.tolist()
            assert len(a.top) == K and a.top[0][1] == max(lp for _, lp in a.top)
            if a.rank == 1:  # lm-eval's greedy check: the very same float
                assert a.logprob == a.top[0][1]


def test_max_tokens_0_scores_the_prompt_only(tiny_model, tokenizer, rotations):
    engine = _engine("recompute", tiny_model, tokenizer, rotations, 16)
    prompt = _prompt(len(tokenizer), 30, seed=3)
    (outputs,) = _run(engine, [prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].finish_reason == "length"
    assert outputs[0].new_token_ids == [] and outputs[0].num_output_tokens == 0
    entries = outputs[0].prompt_logprobs
    expected = _teacher_forced(tiny_model, prompt)
    assert [e.logprob for e in entries[1:]] == pytest.approx(
        [expected[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)], abs=1e-5)
    assert all(e.top == [] for e in entries[1:])
    assert engine.page_manager.window_pool.num_used == engine.page_manager.quant_pool.num_used == 0
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)  # generating nothing is only for scoring


def test_offline_generate_returns_prompt_logprobs(tiny_model, tokenizer):
    prompt = _prompt(len(tokenizer), 12, seed=5)
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    (request,) = LLM(tiny_model, tokenizer=tokenizer).generate([prompt], scoring)
    expected = _teacher_forced(tiny_model, prompt)
    assert request.outputs[0].token_ids == [] and request.prompt_logprobs[0] is None
    assert [e.logprob for e in request.prompt_logprobs[1:]] == pytest.approx(
        [expected[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)], abs=1e-5)


def test_a_scoring_request_gets_no_prefix_hit(tiny_model, tokenizer, rotations):
    """The same prompt again: a plain request hits the prefix cache, a scoring one is prefilled
    from position 0, and scores what a first request does."""
    engine = _engine("bf16", tiny_model, tokenizer, rotations, 16)
    prompt = _prompt(len(tokenizer), 40, seed=4)
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    first = _run(engine, [prompt], scoring)[0][0]
    _run(engine, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
    hits = engine.stats()["prefix_cache_hit_tokens"]
    assert hits > 0
    again = _run(engine, [prompt], scoring)[0][0]
    assert engine.stats()["prefix_cache_hit_tokens"] == hits and again.num_cached_prompt_tokens == 0
    assert [e.logprob for e in again.prompt_logprobs[1:]] == [e.logprob for e in first.prompt_logprobs[1:]]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "int2"])
def test_prompt_logprobs_on_the_gpu_path(kind, tiny_model, tokenizer, rotations):
    """The Triton kernels, CUDA graphs for the decode steps and overlapped steps: scoring rows
    run eagerly beside decoding ones, and equal the one-shot forward (float32 model; the
    kernels' own rounding: 1e-3)."""
    model = copy.deepcopy(tiny_model).cuda()
    ref = _reference(kind, model, rotations)
    engine = _engine(kind, model, tokenizer, rotations, 16)
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [_prompt(len(tokenizer), n, seed=10 + n) for n in (45, 20, 33)]
    engine.add_request(_prompt(len(tokenizer), 9, seed=9), plain)  # decoding while the others score
    results = _run(engine, prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2))
    for prompt, outputs in zip(prompts, results, strict=True):
        expected = _teacher_forced(ref, prompt).cpu()
        entries = outputs[0].prompt_logprobs
        got = torch.tensor([e.logprob for e in entries[1:]])
        want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()
        assert all(e.logprob == e.top[0][1] for e in entries[1:] if e.rank == 1)


def test_blocked_scoring_equals_scoring_every_row_at_once(monkeypatch):
    """Rows scored a few at a time, gathered per block by index, give the very numbers of one
    whole pass (each row's log-softmax, rank and top-k do not depend on its neighbours)."""
    from oscar_compile.runtime.worker import logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(23, 50, generator=g) * 4
    logits[5, 7] = logits[5].max() + 1  # a greedy target: its logprob and the top-1 value are one float
    rows = [0, 2, 3, 5, 8, 13, 21, 22, 1]
    targets = torch.randint(0, 50, (len(rows),), generator=g).tolist()
    targets[3] = 7
    whole = logprobs.score_tokens(logits[rows], targets, 4)
    monkeypatch.setattr(logprobs, "SCORE_BLOCK_BYTES", 3 * 50 * 4)  # blocks of 3 rows, the last of 0
    blocked = logprobs.score_tokens(logits, targets, 4, rows=rows)
    assert blocked == whole and blocked.ranks[3] == 1 and blocked.logprobs[3] == blocked.top_logprobs[3][0]
    assert logprobs.score_tokens(logits[:2], [1, 2], 0, rows=None).top_ids == [[], []]
    assert logprobs.score_tokens(logits, [], 4, rows=[]) == logprobs.ScoredTokens([], [], [], [])


def test_a_scoring_step_keeps_only_its_drawing_rows_logits(tiny_model, tokenizer):
    """The rows that draw a token are copied out of a scoring step's logits: a view would keep
    every scored row's logits (8192 x vocab in float32) alive while the step is in flight, beside
    the next step's, which the memory plan's profile run does not count."""
    from oscar_compile.runtime.worker.model_worker import Worker

    engine = _engine("bf16", tiny_model, tokenizer, None, 64)
    kept = []
    execute = Worker.execute

    def spy(self, batch, *args):
        forward, scores = execute(self, batch, *args)
        if batch.logit_rows and forward is not None:
            kept.append((forward.logits.shape, forward.logits.untyped_storage().nbytes()))
        return forward, scores

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Worker, "execute", spy)
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
        _run(engine, [_prompt(len(tokenizer), 30, seed=3)], params)
    assert kept, "no step scored a prompt and drew a token"
    for shape, nbytes in kept:
        assert nbytes == shape.numel() * 4  # the drawing rows alone, float32
