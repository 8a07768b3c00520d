"""The compressed runner: the runtime's greedy output equals generate() on the same compressed model."""
import copy

import pytest
import torch

from oscar_compile import CompressionSpec, calibrate
from oscar_compile.formats.prefill import PROMPT_EXACT
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.core.sequence import Sequence
from oscar_compile.runtime.engine_config import EngineConfig
from oscar_compile.spec import specs_dir

SPEC = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"center": True}, "value": {"granularity": "per_head"},
})


@pytest.fixture(scope="module")
def setup(tokenizer, tiny_model):
    model = tiny_model
    rot = calibrate(model, SPEC, [torch.randint(0, len(tokenizer), (2, 48),
                                               generator=torch.Generator().manual_seed(0))])
    return tokenizer, model, rot


def _prompts(vocab, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference(model, rot, prompt, max_new):
    from oscar_compile import apply

    ref = copy.deepcopy(model)
    apply(ref, SPEC, rot)
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_runtime_greedy_equals_generate_on_the_compressed_model(setup):
    tokenizer, model, rot = setup
    # the whole prompt in one prefill chunk, as generate() does
    config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=256)
    llm = LLM(copy.deepcopy(model), spec=SPEC, rotations=rot, tokenizer=tokenizer, config=config)
    prompts = _prompts(len(tokenizer), [5, 17, 30])
    # min_tokens masks EOS as generate()'s min_new_tokens does (with ignore_eos the engine may pick
    # EOS, token 0, where generate() cannot: the 17-token prompt's 10th step does so here)
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == _reference(model, rot, prompt, 24)
    for pool in (llm.engine.page_manager.window_pool, llm.engine.page_manager.quant_pool):
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_pages


def test_bf16_mode_serves_the_plain_model(setup):
    tokenizer, model, _ = setup
    bf16 = CompressionSpec.from_dict({"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"},
                                      "value": {"rotation": "none"}})
    config = EngineConfig(num_window_pages=4, num_quant_pages=64, max_num_batched_tokens=256)
    llm = LLM(copy.deepcopy(model), spec=bf16, tokenizer=tokenizer, config=config)
    prompt = _prompts(len(tokenizer), [12], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0].outputs[0]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.token_ids == expected[0, len(prompt):].tolist()


MIXED_SPECS = {  # 16-bit layers beside an INT2 layer
    # 16 bits by default (rotated: exact at 16 bits), layer 1 quantized, no windows: 16-bit layers
    # keep every token in a full-precision page, the INT2 layer every token past the sink in history
    "no-windows": {"kv_cache": {"bits": 16, "group_size": 16, "sink_tokens": 0, "recent_tokens": 0, "page_size": 4},
                   "key": {"rotation": "hadamard"}, "value": {"rotation": "hadamard"},
                   "layers": [{"match": [1], "kv_cache": {"bits": 2}}]},
    # the same with windows: the 16-bit layers share the INT2 layer's windows and page tables
    "windows": {"kv_cache": {"bits": 16, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
                "key": {"rotation": "hadamard"}, "value": {"rotation": "hadamard"},
                "layers": [{"match": [1], "kv_cache": {"bits": 2}}]},
    # INT2 by default, the first layer overridden to 16 bits (not rotated)
    "override": {**SPEC.model_dump(), "layers": [{"match": [0], "kv_cache": {"bits": 16}}]},
}


@pytest.mark.parametrize("name", list(MIXED_SPECS))
def test_mixed_16_bit_and_int2_layers_equal_generate(setup, name):
    """Prompts past sink + recent, each in one chunk, decoded side by side: the 16-bit layers read
    their history rows back as they were written."""
    from oscar_compile import apply

    tokenizer, model, _ = setup
    spec = CompressionSpec.from_dict(MIXED_SPECS[name])
    rot = calibrate(model, spec, [torch.randint(0, len(tokenizer), (2, 48),
                                               generator=torch.Generator().manual_seed(0))])
    config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=256)
    llm = LLM(copy.deepcopy(model), spec=spec, rotations=rot, tokenizer=tokenizer, config=config)
    prompts = _prompts(len(tokenizer), [19, 6, 33], seed=4)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    ref = copy.deepcopy(model)
    apply(ref, spec, rot)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()
    for pool in (llm.engine.page_manager.window_pool, llm.engine.page_manager.quant_pool):
        assert pool.num_used == 0
    # layer 0 keeps 16 bits and sees no quantized layer before it: its outputs, history read back
    # included, are the original model's (runtime and generate() alone share the op, so could
    # agree on a wrong history read)
    prompt = _prompts(len(tokenizer), [33], seed=5)[0]  # a new prompt: no prefix-cache hit
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    served = _layer_outputs(llm.model, 0, lambda: outputs.append(llm.generate([prompt], params)[0].outputs[0]))
    full = prompt + outputs[-1].token_ids[:-1]
    original = _layer_outputs(model, 0, lambda: model(torch.tensor([full])))
    assert torch.allclose(torch.cat(served)[:len(full)], original[0], atol=1e-4)


def test_prefix_hits_past_the_sink_keep_a_16_bit_layer_exact(setup):
    """A hit on history pages with layer 0 overridden to 16 bits: its shared history rows are
    the tokens as written, so the hit's layer-0 outputs (partial ring, history_lens past the
    standard, as in the INT2 hit test above) stay the original model's. History hits are the
    prompt-exact semantics' (prefix_hits="history")."""
    tokenizer, model, _ = setup
    spec = CompressionSpec.from_dict(MIXED_SPECS["override"])
    rot = calibrate(model, spec, [torch.randint(0, len(tokenizer), (2, 48),
                                               generator=torch.Generator().manual_seed(0))])
    shared = _prompts(len(tokenizer), [40], seed=7)[0]
    first, second = [shared + tail for tail in _prompts(len(tokenizer), [6, 11], seed=107)]
    config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=5,
                          prefill_semantics=PROMPT_EXACT)
    llm = LLM(copy.deepcopy(model), spec=spec, rotations=rot, tokenizer=tokenizer, config=config)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate([first], params)
    outputs = []
    served = _layer_outputs(llm.model, 0, lambda: outputs.append(llm.generate([second], params)[0].outputs[0]))
    assert llm.engine.page_manager.num_prefix_hit_tokens == len(shared)
    full = second + outputs[0].token_ids[:-1]
    original = _layer_outputs(model, 0, lambda: model(torch.tensor([full])))[0]
    assert torch.allclose(torch.cat(served)[:len(full) - len(shared)], original[len(shared):], atol=1e-4)


def _layer_outputs(model, index: int, run) -> list[torch.Tensor]:
    """The [N, hidden] outputs of decoder layer ``index`` in every forward that ``run`` makes."""
    rows = []

    def hook(module, args, out):
        rows.append((out[0] if isinstance(out, tuple) else out)[0].detach().clone())

    handle = model.model.layers[index].register_forward_hook(hook)
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return rows


def test_prefix_cache_hits_on_the_sink_equal_misses_with_the_int2_runner(setup):
    """Sink pages are shared between requests with a common prefix; outputs do not change
    (prompt-exact prefill with history hits turned off; decode-consistent hits:
    test_decode_consistent_prefill.py)."""
    tokenizer, model, rot = setup
    shared = _prompts(len(tokenizer), [20], seed=7)[0]
    prompts = [shared + tail for tail in _prompts(len(tokenizer), [6, 11, 3], seed=8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=256,
                              enable_prefix_caching=caching, prefill_semantics=PROMPT_EXACT)
        llm = LLM(copy.deepcopy(model), spec=SPEC, rotations=rot, tokenizer=tokenizer, config=config)
        llm.engine.page_manager.history_hits = False  # hits stop at the sink: exact (history hits below)
        outputs[caching] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        # run the prompts again: now every one finds its prefix cached (when caching is on)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == outputs[caching]
        if caching:
            assert llm.engine.page_manager.num_prefix_hit_tokens >= SPEC.kv_cache.sink_tokens
    assert outputs[True] == outputs[False]


def test_prefix_cache_hits_past_the_sink_with_the_int2_runner(setup):
    """A hit on history pages: the shared pages stay intact and the output is close to a miss.

    S0 = 4, W = 8, P = 4. The second request shares 40 prompt tokens with the first and reuses
    them all (sink page + 9 history pages), starting from an empty ring (history_lens = 36 > the
    standard max(0, L - W - S0) = 28). A budget of 5 < W tokens per step keeps the ring partial
    for two steps, so the ops run with history_lens past the standard value and demote only what
    the ring holds. Exact equality with a miss is not expected: the miss run's tokens [40, 51)
    read positions [32, 40) from its full-precision ring, the hit's from INT2 history (the
    page_manager docstring, "Exactness"). Greedy decoding amplifies any difference at a near-tie,
    so the check is on the first token and its logprob (0.05 nats apart here; a runner that
    demoted stale ring slots into the shared pages moves it by 0.2 - 0.7 and the pages change).
    Staging is off in both runs (``num_staging_pages=0``): both then chunk their prompts the same
    way and the difference is the hit's alone (with staging, the miss's chunks would attend to
    each other in full precision, test_exact_prefill.py). History hits are the prompt-exact
    semantics' (prefix_hits="history").
    """
    tokenizer, model, rot = setup
    shared = _prompts(len(tokenizer), [40], seed=7)[0]
    first, second = [shared + tail for tail in _prompts(len(tokenizer), [6, 11], seed=107)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    outputs = {}
    for caching in (True, False):
        config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=5,
                              enable_prefix_caching=caching, num_staging_pages=0, prefill_semantics=PROMPT_EXACT)
        llm = LLM(copy.deepcopy(model), spec=SPEC, rotations=rot, tokenizer=tokenizer, config=config)
        bm, runner = llm.engine.page_manager, llm.engine.runner
        assert bm.history_hits
        llm.generate([first], params)
        hit_pages = list(bm.match_prefix(Sequence(second)).quant_pages)  # cached after the first
        before = [[pool[hit_pages].clone() for pool in pools[2:]] for pools in runner.pools]
        request = llm.generate([second], params)[0]
        outputs[caching] = request.outputs[0]
        if caching:
            assert bm.num_prefix_hit_tokens == len(shared) and len(hit_pages) == 9
            assert request.num_cached_tokens == len(shared)  # reported after the finish
            for pools, saved in zip(runner.pools, before, strict=True):  # codes, scales, zeros of every layer
                for pool, old in zip(pools[2:], saved, strict=True):
                    assert torch.equal(pool[hit_pages], old)
        assert len(outputs[caching].token_ids) == 16 and outputs[caching].finish_reason == "length"
        for pool in (bm.window_pool, bm.quant_pool):
            assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_pages
    hit, miss = outputs[True], outputs[False]
    assert hit.token_ids[0] == miss.token_ids[0]
    assert abs(hit.logprobs[0].logprob - miss.logprobs[0].logprob) < 0.1


def test_bf16_mode_prefix_cache_hits_equal_misses(setup):
    """W = 0 (specs/bf16.yaml): a hit reuses full-precision pages, the classic paged hit - exact."""
    tokenizer, model, _ = setup
    bf16 = CompressionSpec.from_yaml(specs_dir() / "bf16.yaml")
    P = bf16.kv_cache.page_size
    shared = _prompts(len(tokenizer), [3 * P + 5], seed=9)[0]
    prompts = [shared + tail for tail in _prompts(len(tokenizer), [4, 9], seed=10)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        config = EngineConfig(num_window_pages=4, num_quant_pages=64, max_num_batched_tokens=16,
                              enable_prefix_caching=caching)
        llm = LLM(copy.deepcopy(model), spec=bf16, tokenizer=tokenizer, config=config)
        outputs[caching] = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
        assert llm.engine.page_manager.num_prefix_hit_tokens == (3 * P if caching else 0)
    assert outputs[True] == outputs[False]



def test_runner_sizes_its_page_tables_by_the_context_limit(setup):
    """Not by the whole pool: the tables are mirrored on the host and copied every step."""
    tokenizer, model, rot = setup
    llm = LLM(copy.deepcopy(model), spec=SPEC, rotations=rot, tokenizer=tokenizer,
              config=EngineConfig(kv_memory_gb=0.05))
    runner = llm.engine.runner
    limit = model.config.max_position_embeddings
    assert runner.quant_width == -(-limit // SPEC.kv_cache.page_size) < llm.engine.page_manager.quant_pool.num_pages


def test_mask_bypass_restores_every_config():
    """The setter renames sub-configs too; each gets its own value back (here: a multimodal config)."""
    from transformers import LlavaConfig

    from oscar_compile.runtime.worker.compressed_runner import _NO_MASK_IMPLEMENTATION, _without_hf_masks

    config = LlavaConfig()
    parts = (config, config.text_config, config.vision_config)
    for part, name in zip(parts, ("sdpa", "eager", "sdpa"), strict=True):
        part._attn_implementation_internal = name
    with _without_hf_masks(config):
        assert all(part._attn_implementation == _NO_MASK_IMPLEMENTATION for part in parts)
    assert [part._attn_implementation for part in parts] == ["sdpa", "eager", "sdpa"]


BF16_SPEC = CompressionSpec.from_dict({"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"},
                                       "value": {"rotation": "none"}})


@pytest.mark.parametrize("bf16, max_model_len, max_seqs", [(False, None, 64), (True, 4, 1)])
def test_kernel_warm_up_steps_touch_only_the_scratch_pages(setup, bf16, max_model_len, max_seqs):
    """The prefill-shaped steps a GPU runner runs at startup (to compile kernel variants) write
    the scratch pages only: run mid-service here, they change no other page and no output. Also
    with page tables one page wide (BF16 mode, 4-token pages, 4-token context) and one sequence."""
    tokenizer, model, rot = setup
    config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=256,
                          enable_prefix_caching=False, max_model_len=max_model_len, max_num_seqs=max_seqs)
    spec, rotations = (BF16_SPEC, None) if bf16 else (SPEC, rot)
    llm = LLM(copy.deepcopy(model), spec=spec, rotations=rotations, tokenizer=tokenizer, config=config)
    runner = llm.engine.runner
    prompts = _prompts(len(tokenizer), [2, 3] if bf16 else [5, 30])
    params = SamplingParams(max_tokens=1 if bf16 else 12, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    before = [[t.clone() for t in pools] for pools in runner.pools]
    runner._compile_prefill_kernels(runner.layout)
    scratch_written = False
    for now_pools, then_pools in zip(runner.pools, before, strict=True):
        for now, then in zip(now_pools, then_pools, strict=True):
            assert torch.equal(now[:-1], then[:-1])  # every page but the last (scratch) one
            scratch_written |= not torch.equal(now[-1], then[-1])
    assert scratch_written
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == first
