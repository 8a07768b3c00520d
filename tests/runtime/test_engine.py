"""The engine end to end with the exact RecomputeRunner on a tiny random Qwen3 (CPU).

With a windowed (INT-b) layout the RecomputeRunner still runs the plain model: only the page
bookkeeping is the layout's. Those engines ask for the prompt-exact prefill semantics (history
hits, staging), whose bookkeeping this checks: build_engine refuses a runner that does not run
decode-consistent prefill, the default, over a quantizing layout
(test_decode_consistent_prefill.py tests that semantics' engine with the compressed runner).
"""

from __future__ import annotations

import random

import pytest
import torch

from oscar_compile.formats.prefill import PROMPT_EXACT
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.sampling_params import RequestError, SamplingParams
from oscar_compile.runtime.engine import LLMEngine
from oscar_compile.runtime.engine_config import BUNDLED_MODEL_DIR, EngineConfig, build_engine, resolve_model_dir
from oscar_compile.runtime.llm import LLM
from oscar_compile.spec import specs_dir

GREEDY = dict(temperature=0.0)
WINDOWED = dict(sink=16, recent=16)


def windowed_layout(model) -> CacheLayout:
    return CacheLayout.from_hf_config(model.config, page_size=16, group_size=16, **WINDOWED)


def windowed_config(model, **kwargs) -> EngineConfig:
    """An engine config over ``windowed_layout`` for the RecomputeRunner: prompt-exact (see above)."""
    return EngineConfig(layout=windowed_layout(model), prefill_semantics=PROMPT_EXACT, **kwargs)


def run_all(engine: LLMEngine, requests) -> list[list[int]]:
    seqs = [engine.add_request(list(ids), params) for ids, params in requests]
    while engine.has_unfinished():
        engine.step()
    assert_all_pages_free(engine)
    return [s.output_token_ids for s in seqs]


def assert_all_pages_free(engine: LLMEngine) -> None:
    for pool in (engine.page_manager.window_pool, engine.page_manager.quant_pool):
        assert pool.num_used == 0 and all(count == 0 for count in pool.ref_counts)


def random_prompts(tokenizer, count: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    stem = [rng.randrange(3, len(tokenizer)) for _ in range(shared)]
    return [stem + [rng.randrange(3, len(tokenizer)) for _ in range(rng.randrange(1, 60))]
            for _ in range(count)]


def test_greedy_output_equals_hf_generate(tiny_model, tokenizer):
    llm = LLM(tiny_model, tokenizer=tokenizer, config=EngineConfig(max_num_batched_tokens=32))
    prompts = ["hello world", "The quick brown fox", "A paged KV cache stores keys", "x"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    for prompt, request in zip(prompts, outputs, strict=True):
        (out,) = request.outputs
        ids = torch.tensor([tokenizer.encode(prompt)])
        reference = tiny_model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:]
        assert out.token_ids == reference.tolist()
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == 0 else "length")


def test_many_concurrent_requests_of_mixed_lengths_complete(tiny_model, tokenizer):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(max_num_seqs=8, max_num_batched_tokens=48))
    prompts = random_prompts(tokenizer, 40, seed=1)
    lengths = [random.Random(i).randrange(1, 20) for i in range(40)]
    outputs = run_all(engine, [(p, SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY))
                               for p, n in zip(prompts, lengths, strict=True)])
    assert [len(o) for o in outputs] == lengths
    assert engine.stats()["num_requests_finished"] == 40


@pytest.mark.parametrize("windowed", [False, True])
def test_a_tiny_page_budget_preempts_without_changing_greedy_output(tiny_model, tokenizer, windowed):
    layout = windowed_layout(tiny_model) if windowed else None
    requests = [(p, SamplingParams(max_tokens=30, ignore_eos=True, **GREEDY))
                for p in random_prompts(tokenizer, 10, seed=2)]
    roomy = build_engine(tiny_model, tokenizer, EngineConfig(layout=layout, num_window_pages=100,
                                                             num_quant_pages=1000, enable_prefix_caching=False,
                                                             prefill_semantics=PROMPT_EXACT))
    tight = build_engine(tiny_model, tokenizer, EngineConfig(
        layout=layout, num_window_pages=8 if windowed else 0, num_quant_pages=8,
        max_num_batched_tokens=24, prefill_semantics=PROMPT_EXACT))
    assert run_all(tight, requests) == run_all(roomy, requests)
    assert tight.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0


@pytest.mark.parametrize("windowed", [False, True])
def test_prefix_cache_hits_give_the_same_output_as_misses(tiny_model, tokenizer, windowed):
    layout = windowed_layout(tiny_model) if windowed else None
    prompts = random_prompts(tokenizer, 12, seed=3, shared=70)
    requests = [(p, SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY)) for p in prompts]
    config = dict(layout=layout, num_window_pages=60, num_quant_pages=200, max_num_seqs=4,
                  max_num_batched_tokens=64, prefill_semantics=PROMPT_EXACT)
    hits = build_engine(tiny_model, tokenizer, EngineConfig(**config))
    misses = build_engine(tiny_model, tokenizer, EngineConfig(**config, enable_prefix_caching=False))
    assert run_all(hits, requests) == run_all(misses, requests)
    assert hits.page_manager.num_prefix_hit_tokens >= 8 * 48
    assert misses.page_manager.num_prefix_hit_tokens == 0


def test_a_seed_gives_the_same_tokens_alone_batched_and_preempted(tiny_model, tokenizer):
    prompt = tokenizer.encode("The quick brown fox")
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = run_all(build_engine(tiny_model, tokenizer), [(prompt, seeded)])[0]
    others = [(p, SamplingParams(max_tokens=25, ignore_eos=True)) for p in random_prompts(tokenizer, 6, seed=4)]
    tight = build_engine(tiny_model, tokenizer, EngineConfig(num_window_pages=0, num_quant_pages=8,
                                                             max_num_batched_tokens=16))
    outputs = run_all(tight, others[:3] + [(prompt, seeded)] + others[3:])
    assert outputs[3] == alone and tight.scheduler.num_preemptions > 0


def test_finish_reasons_and_stop_handling(tiny_model, tokenizer):
    llm = LLM(tiny_model, tokenizer=tokenizer, config=EngineConfig(max_model_len=40))
    prompt = tokenizer.encode("hello world")
    free = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_token = free.token_ids[5]
    by_token = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[stop_token],
                                                   ignore_eos=True, **GREEDY))[0].outputs[0]
    first = free.token_ids.index(stop_token)
    assert by_token.finish_reason == "stop" and by_token.token_ids == free.token_ids[:first + 1]
    stop_text = free.text[4:7]
    by_text = llm.generate(prompt, SamplingParams(max_tokens=12, stop=[stop_text], ignore_eos=True,
                                                  **GREEDY))[0].outputs[0]
    assert by_text.finish_reason == "stop" and by_text.text == free.text[:free.text.index(stop_text)]
    by_context = llm.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY))[0].outputs[0]
    assert by_context.finish_reason == "length" and len(prompt) + len(by_context.token_ids) == 40
    logprobs = llm.generate(prompt, SamplingParams(max_tokens=3, logprobs=2, **GREEDY))[0].outputs[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in logprobs)


def test_bad_requests_raise_request_error_and_leave_nothing_queued(tiny_model, tokenizer):
    engine = build_engine(tiny_model, tokenizer, EngineConfig(max_model_len=64))
    for ids, params, param in [([], SamplingParams(), "prompt"), ([1, 10**6], SamplingParams(), "prompt"),
                               ([1] * 64, SamplingParams(), "prompt")]:
        with pytest.raises(RequestError) as info:
            engine.add_request(ids, params)
        assert info.value.param == param
    llm = LLM(tiny_model, tokenizer=tokenizer, config=EngineConfig(max_model_len=64))
    with pytest.raises(RequestError):
        llm.generate([[1, 2, 3], [1] * 80])
    assert not llm.engine.has_unfinished()


def test_abort_frees_the_pages_at_once(tiny_model, tokenizer):
    engine = build_engine(tiny_model, tokenizer, windowed_config(tiny_model, num_window_pages=10, num_quant_pages=20))
    # ignore_eos: an unseeded draw ended the request at its first token once (CI, an EOS of the random model)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    seq = engine.add_request(random_prompts(tokenizer, 1, seed=5)[0] * 2, params)
    engine.step()
    assert seq.has_pages
    [out] = engine.abort_request(seq.request_id)
    assert out.finished and out.finish_reason == "abort" and out.request_finished
    assert engine.abort_request(seq.request_id) == []
    assert_all_pages_free(engine)
    assert not engine.has_unfinished()


def test_llm_loads_a_model_directory(model_dir):
    llm = LLM(str(model_dir), device="cpu")
    (request,) = llm.generate("hello", SamplingParams(max_tokens=5, **GREEDY))
    assert len(request.outputs[0].token_ids) >= 1 and request.prompt_token_ids == llm.tokenizer.encode("hello")
    with pytest.raises(ValueError, match="pass rotations="):
        LLM(str(model_dir), spec="specs/oscar-int2.yaml")
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_dir(model_dir / "missing")
    if not (BUNDLED_MODEL_DIR / "config.json").exists():
        with pytest.raises(FileNotFoundError, match="--model"):
            resolve_model_dir(None)


def test_a_runner_factory_sizes_its_pools_from_the_page_manager(tiny_model, tokenizer):
    from oscar_compile.runtime.core.config import RunnerCapabilities
    from oscar_compile.runtime.worker.runner import RecomputeRunner, RunnerFactory

    seen = {}
    # e.g. a runner whose cache_write ignores history_lens: no history hits
    capabilities = RunnerCapabilities(prompt_logits=True, page_copies=True)

    def build(page_manager):
        seen["pages"] = (page_manager.window_pool.num_pages, page_manager.quant_pool.num_pages)
        runner = RecomputeRunner(tiny_model)
        runner.capabilities = capabilities
        return runner

    config = windowed_config(tiny_model, num_window_pages=6, num_quant_pages=9)
    engine = build_engine(tiny_model, tokenizer, config, make_runner=RunnerFactory(capabilities, build))
    assert seen["pages"] == (6, 9) and engine.page_manager.history_hits is False
    assert build_engine(tiny_model, tokenizer, config).page_manager.history_hits is True
    with pytest.raises(TypeError, match="RunnerFactory"):  # a runner's capabilities are declared, not probed
        build_engine(tiny_model, tokenizer, config, make_runner=build)
    lying = RunnerFactory(RunnerCapabilities(), build)
    with pytest.raises(ValueError, match="factory declared"):
        build_engine(tiny_model, tokenizer, config, make_runner=lying)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engine_runs_on_cuda(tiny_model, tokenizer):
    import copy

    model = copy.deepcopy(tiny_model).to("cuda")
    llm = LLM(model, tokenizer=tokenizer, config=EngineConfig(max_num_batched_tokens=32))
    prompt = tokenizer.encode("The quick brown fox")
    greedy = llm.generate([prompt] * 3, SamplingParams(max_tokens=16, logprobs=1, **GREEDY))
    reference = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False)
    assert greedy[0].outputs[0].token_ids == reference[0, len(prompt):].tolist()
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    batched = llm.generate([tokenizer.encode("hello")] * 4 + [prompt], [SamplingParams(max_tokens=9)] * 4 + [seeded])
    assert batched[-1].outputs[0].token_ids == alone
    assert_all_pages_free(llm.engine)


class _OutputPenalties:
    """OpenAI's presence / frequency penalties in plain torch, as a transformers logits processor:
    ``logit -= presence * (count > 0) + frequency * count`` over the generated tokens only."""

    def __init__(self, num_prompt: int, presence: float, frequency: float):
        self.num_prompt, self.presence, self.frequency = num_prompt, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        output = input_ids[:, self.num_prompt:]
        counts.scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


@pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="the bundled model is not shipped")
def test_sampling_controls_on_the_bundled_model_equal_transformers_generate():
    """Greedy with each control, through the engine, gives transformers' generate with its own
    processors (plain torch for presence / frequency); each changes the greedy output."""
    transformers = pytest.importorskip("transformers")
    llm = LLM(str(BUNDLED_MODEL_DIR), device="cpu", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(BUNDLED_MODEL_DIR), use_kernels=False).float().eval()
    ids = llm.tokenizer.encode("def fibonacci(n):")
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    plain = llm.generate([ids], greedy)[0].outputs[0].token_ids
    bias_token = plain[3]
    cases = [
        (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
        (dict(logit_bias={bias_token: -100.0, 777: 4.0}), dict(sequence_bias={(bias_token,): -100.0, (777,): 4.0})),
        (dict(presence_penalty=1.2, frequency_penalty=0.6),
         dict(logits_processor=transformers.LogitsProcessorList([_OutputPenalties(len(ids), 1.2, 0.6)]))),
    ]
    for controls, hf_kwargs in cases:
        out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, **controls))[0].outputs[0]
        with torch.no_grad():
            reference = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, **hf_kwargs)
        assert out.token_ids == reference[0, len(ids):].tolist(), controls
        assert out.token_ids != plain, controls
        # the logprobs are the model's own, before the controls
        with torch.no_grad():
            full = hf(torch.tensor([ids + out.token_ids[:-1]])).logits[0, len(ids) - 1:].log_softmax(-1)
        own = full.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(own.tolist(), abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not (BUNDLED_MODEL_DIR / "config.json").exists(), reason="the bundled model is not shipped")
def test_sampling_controls_on_cuda_with_overlapped_steps_and_cuda_graphs():
    """On the GPU (CUDA graphs, overlapped steps: the pending token is read from the device) a
    batch mixing controlled and plain requests gives the tokens of one-step-at-a-time stepping."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "# sort a list", "for i in range(10):"]
    controls = [dict(repetition_penalty=1.5), dict(), dict(frequency_penalty=1.0, presence_penalty=0.5),
                dict(logit_bias={777: 100.0}), dict(min_tokens=30, min_p=0.2, temperature=0.8, seed=5)]
    params = [SamplingParams(**{"max_tokens": 30, "temperature": 0.0, **c}) for c in controls]
    outputs = {}
    for overlap in (True, False):
        llm = LLM(str(BUNDLED_MODEL_DIR), str(specs_dir() / "oscar-int2.yaml"),
                  str(BUNDLED_MODEL_DIR / "rotations" / "oscar-int2.safetensors"), device="cuda",
                  config=EngineConfig(overlap_steps=overlap))
        assert llm.engine.overlap is overlap
        outputs[overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        plain = llm.generate(prompts[:1], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0].token_ids
        assert_all_pages_free(llm.engine)
        llm.close()
    assert outputs[True] == outputs[False]
    assert outputs[True][0] != plain and outputs[True][3] == [777] * 30 and len(outputs[True][4]) == 30


def test_a_batch_without_controls_builds_none_and_finished_requests_leave_no_copies(tiny_model, tokenizer):
    engine = build_engine(tiny_model, tokenizer)
    seen = []
    sample = engine.worker.sampler.sample

    def spy(logits, params, seeds, positions, controls=None, bitmask=None):
        seen.append(controls)
        assert bitmask is None  # no grammar either
        return sample(logits, params, seeds, positions, controls, bitmask)

    engine.worker.sampler.sample = spy
    prompts = random_prompts(tokenizer, 3, seed=5)
    run_all(engine, [(p, SamplingParams(max_tokens=5, top_k=5, min_p=0.1, seed=1)) for p in prompts])
    assert seen and all(c is None for c in seen)  # no control used: the sampler runs what it ran before
    seen.clear()
    run_all(engine, [(prompts[0], SamplingParams(max_tokens=5, **GREEDY)),
                     (prompts[1], SamplingParams(max_tokens=5, repetition_penalty=1.2, **GREEDY))])
    assert any(c is not None for c in seen)
    assert not engine.worker.sampler.token_cache._prompt and not engine.worker.sampler.token_cache._output
