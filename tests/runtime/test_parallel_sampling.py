"""Parallel sampling (issue #30, item 4): ``SamplingParams.n`` choices forked from one prefill.

The compressed runner on the CPU with real pages, INT2 (sink 4, ring 8, pages of 4 tokens) and
the BF16 mode: choice ``i`` of a request with seed ``s`` is the request alone with seed ``s + i``
(the same tokens; logprobs equal up to the float rounding a batch's shape brings), which holds
only if its forked window pages and partial history page hold what the request alone would have
(without the device copies choices 1.. diverge);
the prompt's full pages are held once; an abort ends every choice; preemption (swap and
recompute) keeps the outputs; admission counts the pages of every choice.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from oscar_compile import CompressionSpec, apply, calibrate
from oscar_compile.loading import BUNDLED_MODEL_DIR
from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig, build_engine
from oscar_compile.runtime.llm import LLM
from oscar_compile.runtime.server.metrics import render_metrics
from oscar_compile.runtime.worker.compressed_runner import compressed_layout, runner_factory

parser = pytest.importorskip("prometheus_client.parser")

INT2 = CompressionSpec.from_dict(
    {
        "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
        "key": {"rotation": "hadamard"},
        "value": {"rotation": "hadamard"},
    }
)
BF16 = CompressionSpec.from_dict(
    {"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"}, "value": {"rotation": "none"}}
)
ROOMY = dict(num_window_pages=64, num_quant_pages=128)
PROMPT_LEN = 23  # INT2: history 11 tokens (2 full pages + a partial one); BF16: 5 full + a partial


@pytest.fixture(scope="module")
def compressed(tiny_model):
    models = {}
    for name, spec in (("int2", INT2), ("bf16", BF16)):
        model = copy.deepcopy(tiny_model)
        models[name] = (apply(model, spec, calibrate(model, spec)), spec)  # Hadamard / none: no data needed
    return models


@pytest.fixture(scope="module")
def prompt(tokenizer):
    rng = random.Random(3)
    return [rng.randrange(3, len(tokenizer)) for _ in range(PROMPT_LEN)]


def _engine(compressed, tokenizer, kind="int2", **config):
    handle, spec = compressed[kind]
    model = handle.model
    layout = compressed_layout(model, spec)
    cfg = EngineConfig(layout=layout, **{**ROOMY, **config})
    return build_engine(model, tokenizer, cfg, make_runner=runner_factory(handle, layout, cfg))


def _run(engine, requests):
    """Every request to the end: per request, per choice index, (tokens, logprobs, finish reason)."""
    ids = [engine.add_request(list(p), params).request_id for p, params in requests]
    got = {rid: {} for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs, _ = got[out.request_id].get(out.index, ([], [], None))
            got[out.request_id][out.index] = (
                tokens + out.new_token_ids,
                logprobs + [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs],
                out.finish_reason,
            )
    for pool in (engine.page_manager.window_pool, engine.page_manager.quant_pool):
        assert pool.num_used == 0 and pool.num_shared == 0
    return [got[rid] for rid in ids]


def _assert_same(got, want) -> None:
    """Equal tokens, top-logprob ids and finish reasons; logprobs to 1e-5: a row's logits move by
    float rounding with the batch's shape (4 choices, or 4 prompts prefilled together)."""
    (tokens, logprobs, reason), (want_tokens, want_logprobs, want_reason) = got, want
    assert (tokens, reason) == (want_tokens, want_reason)
    assert [[t for t, _ in lp[2]] for lp in logprobs] == [[t for t, _ in lp[2]] for lp in want_logprobs]
    assert [lp[1] for lp in logprobs] == pytest.approx([lp[1] for lp in want_logprobs], abs=1e-5)


def _sampled(seed, n=1, max_tokens=10, **kwargs):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True, logprobs=2, n=n, **kwargs)


@pytest.mark.parametrize("kind", ["int2", "bf16"])
@pytest.mark.parametrize("overlap", [True, False])
def test_each_choice_is_the_request_alone_with_seed_plus_i(compressed, tokenizer, prompt, kind, overlap):
    [choices] = _run(_engine(compressed, tokenizer, kind, overlap_steps=overlap), [(prompt, _sampled(7, n=4))])
    assert sorted(choices) == [0, 1, 2, 3]
    alone = _run(
        _engine(compressed, tokenizer, kind, overlap_steps=overlap), [(prompt, _sampled(7 + i)) for i in range(4)]
    )
    for i in range(4):
        _assert_same(choices[i], alone[i][0])
    assert len({tuple(tokens) for tokens, _, _ in choices.values()}) == 4  # the choices differ
    [again] = _run(_engine(compressed, tokenizer, kind, overlap_steps=overlap), [(prompt, _sampled(7, n=4))])
    assert again == choices  # and are reproducible


def test_greedy_choices_are_identical(compressed, tokenizer, prompt):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
    [pair] = _run(_engine(compressed, tokenizer), [(prompt, SamplingParams(**{**vars(greedy), "n": 2}))])
    [[single]] = [list(r.values()) for r in _run(_engine(compressed, tokenizer), [(prompt, greedy)])]
    assert pair[0] == pair[1]  # two equal rows of one batch: the very same numbers
    assert pair[0][0] == single[0]


def _gauge(text: str, name: str, **labels) -> float:
    family = next(f for f in parser.text_string_to_metric_families(text) if f.name == name)
    return next(s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items()))


def _prefill_and_fork(engine) -> None:
    """Step until the prompt is in and its choices forked: one step (a window snapshot's boundary,
    20 of 23 tokens under decode-consistent prefill, the default, cuts no chunk)."""
    for _ in range(1):
        engine.step()
        if engine.stats()["fork_quant_pages_shared"]:
            return
    raise AssertionError("the choices were not forked after the prompt's prefill")


def test_the_prompts_full_pages_are_held_once(compressed, tokenizer, prompt):
    engine = _engine(compressed, tokenizer)
    engine.add_request(prompt, _sampled(1, n=4))
    _prefill_and_fork(engine)  # the prompt, prefilled once; then the fork
    text = render_metrics(engine.stats())
    # history 11 tokens: 2 full pages shared by the 4 choices, the partial page copied 3 times
    assert _gauge(text, "oscar_kv_pages_shared", kind="quant") == 2
    assert _gauge(text, "oscar_kv_pages_used", kind="quant") == 2 + 4
    # windows: the sink page (4 tokens, final) shared, the 2 ring pages copied
    assert _gauge(text, "oscar_kv_pages_shared", kind="window") == 1
    assert _gauge(text, "oscar_kv_pages_used", kind="window") == 1 + 4 * 2
    assert _gauge(text, "oscar_forked_pages", kind="quant", how="shared") == 3 * 2
    assert _gauge(text, "oscar_forked_pages", kind="quant", how="copied") == 3
    assert _gauge(text, "oscar_forked_pages", kind="window", how="copied") == 3 * 2
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["quant_pages_used"] == stats["quant_pages_shared"] == 0


def test_an_abort_ends_every_choice(compressed, tokenizer, prompt):
    engine = _engine(compressed, tokenizer)
    seq = engine.add_request(prompt, _sampled(1, n=3, max_tokens=30))
    for _ in range(3):
        engine.step()
    outs = engine.abort_request(seq.request_id)
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "abort" for o in outs) and outs[-1].request_finished
    assert engine.abort_request(seq.request_id) == []
    while engine.has_unfinished():  # the step in flight is read and dropped
        assert engine.step() == []
    stats = engine.stats()
    assert stats["window_pages_used"] == stats["quant_pages_used"] == 0 and stats["num_requests_aborted"] == 1


def test_an_abort_before_the_fork_ends_the_request(compressed, tokenizer, prompt):
    engine = _engine(compressed, tokenizer, max_num_batched_tokens=8)  # the prompt takes 3 chunks
    seq = engine.add_request(prompt, _sampled(1, n=3))
    engine.step()
    [out] = engine.abort_request(seq.request_id)
    assert out.request_finished and out.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["window_pages_used"] == engine.stats()["quant_pages_used"] == 0


@pytest.mark.parametrize("swap_space_gb", [0.0, 0.01])
def test_preempted_choices_keep_their_outputs(compressed, tokenizer, swap_space_gb):
    """BF16 mode (logits do not depend on chunking, so a recomputed choice is exact too): two
    requests of 2 choices, pages for one request at a time."""
    rng = random.Random(5)
    requests = [
        ([rng.randrange(3, len(tokenizer)) for _ in range(10)], _sampled(20 + r, n=2, max_tokens=16)) for r in range(2)
    ]
    roomy = _run(_engine(compressed, tokenizer, "bf16"), requests)
    # each choice reaches 26 tokens (7 pages), the prompt's 2 full pages shared: 12 pages a request
    tight = _engine(
        compressed,
        tokenizer,
        "bf16",
        num_window_pages=1,
        num_quant_pages=16,
        max_num_batched_tokens=16,
        swap_space_gb=swap_space_gb,
    )
    for got, want in zip(_run(tight, requests), roomy, strict=True):
        assert sorted(got) == sorted(want) == [0, 1]
        for i in want:
            _assert_same(got[i], want[i])
    assert tight.scheduler.num_preemptions > 0
    assert (tight.scheduler.num_swap_preemptions > 0) == (swap_space_gb > 0)


def test_admission_counts_the_pages_of_every_choice(compressed, tokenizer, prompt):
    engine = _engine(compressed, tokenizer, num_window_pages=64, num_quant_pages=12, max_num_seqs=4)
    # 23 + 24 tokens: 9 history pages a choice, 2 of them shared
    engine.input_processor.process(prompt, _sampled(1, n=1, max_tokens=24))
    with pytest.raises(RequestError) as err:
        engine.input_processor.process(prompt, _sampled(1, n=2, max_tokens=24))
    assert err.value.param == "max_tokens"
    assert engine.input_processor.max_new_tokens(len(prompt), 2) < engine.input_processor.max_new_tokens(len(prompt), 1)
    with pytest.raises(RequestError) as err:
        engine.input_processor.process(prompt, _sampled(1, n=5))
    assert err.value.param == "n"  # more choices than sequences at once


def test_the_choices_pages_are_reserved_at_admission(compressed, tokenizer, prompt):
    engine = _engine(compressed, tokenizer, max_num_batched_tokens=8)  # the prompt takes 3 chunks
    engine.add_request(prompt, _sampled(1, n=4))
    engine.step()
    stats = engine.stats()
    # the first choice's 3 window pages and 3 x (2 ring pages) for the others; and 3 partial pages
    assert stats["window_pages_used"] == 3 + 3 * 2
    assert stats["quant_pages_used"] == 3
    assert stats["num_running"] == 1


def test_generate_returns_each_prompt_with_its_choices(tiny_model, tokenizer, prompt):
    """``LLM.generate``: one RequestOutput per prompt, its ``n`` choices in ``outputs``, each what
    a request of one seeded ``seed + index`` gives (the exact runner, which keeps no pages: its
    forks copy nothing)."""
    llm = LLM(tiny_model, tokenizer=tokenizer)
    params = _sampled(9, n=3, max_tokens=6)
    outs = llm.generate([prompt, prompt[:5]], params)
    assert [[(c.index, c.seed) for c in o.outputs] for o in outs] == [[(0, 9), (1, 10), (2, 11)]] * 2
    assert [o.prompt_token_ids for o in outs] == [prompt, prompt[:5]]
    alone = llm.generate([prompt] * 3 + [prompt[:5]] * 3, [_sampled(9 + i, max_tokens=6) for i in range(3)] * 2)
    assert [c.token_ids for o in outs for c in o.outputs] == [o.outputs[0].token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="the bundled model is not shipped")
def test_forked_choices_on_cuda_with_overlapped_steps_and_cuda_graphs():
    """On the GPU (Triton kernels, CUDA graphs, the fork's copies queued on the compute stream
    behind the prefill and before the next replay) overlapped steps give the tokens of one step
    at a time; every choice differs and every page is freed."""
    from oscar_compile.spec import specs_dir

    prompts = ["def fibonacci(n):\n    " * 60, "The capital of France is"]  # (the first: INT2 history)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=11, n=4, ignore_eos=True)
    outputs = {}
    for overlap in (True, False):
        llm = LLM(
            str(BUNDLED_MODEL_DIR),
            str(specs_dir() / "hadamard-int2.yaml"),
            device="cuda",
            config=EngineConfig(overlap_steps=overlap),
        )
        outputs[overlap] = [c.token_ids for o in llm.generate(prompts, params) for c in o.outputs]
        stats = llm.engine.stats()
        assert stats["window_pages_used"] == stats["quant_pages_used"] == 0
        assert stats["fork_window_pages_copied"] > 0 and stats["fork_quant_pages_shared"] > 0
        llm.close()
    assert outputs[True] == outputs[False]
    assert len({tuple(t) for t in outputs[True]}) == 8


def test_scoring_the_prompt_alone_gives_every_choice_its_logprobs(compressed, tokenizer, prompt):
    """``max_tokens`` 0 with prompt logprobs (``echo`` with ``n``): each choice ends after the
    prefill with the prompt's logprobs, and no token."""
    engine = _engine(compressed, tokenizer)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1, n=3))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert sorted(o.index for o in outs) == [0, 1, 2] and [o.request_finished for o in outs] == [False, False, True]
    assert all(o.new_token_ids == [] and o.prompt_logprobs is seq.prompt_logprobs for o in outs)
    assert seq.prompt_logprobs[0] is None and None not in seq.prompt_logprobs[1:]
    assert engine.stats()["quant_pages_used"] == 0


def test_a_step_that_fails_after_drawing_the_choices_leaves_no_fork_behind(compressed, tokenizer, prompt):
    """The async engine aborts the requests of a step that raised (a model error): the choices
    it had drawn are dropped, and the next requests run."""
    engine = _engine(compressed, tokenizer)
    seq = engine.add_request(prompt, _sampled(1, n=2))
    sample = engine.worker.sampler.sample

    def failing(*args, **kwargs):
        raise RuntimeError("a model error")

    engine.worker.sampler.sample = failing
    with pytest.raises(RuntimeError, match="a model error"):
        for _ in range(2):  # the prompt's last chunk samples: under decode-consistent prefill its second step
            engine.step()
    engine.worker.sampler.sample = sample
    assert [o.index for o in engine.abort_request(seq.request_id)] == [0]
    [choices] = _run(engine, [(prompt, _sampled(1, n=2))])
    assert sorted(choices) == [0, 1]
