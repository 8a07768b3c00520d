"""The compressed runner: the runtime's greedy output equals generate() on the same compressed model."""
import copy

import pytest
import torch

from oscar_compile import CompressionSpec, calibrate
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.loader import EngineConfig

SPEC = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 16, "sink_tokens": 4, "recent_tokens": 8, "page_size": 4},
    "key": {"center": True}, "value": {"granularity": "per_head"},
})


@pytest.fixture(scope="module")
def setup(tokenizer, tiny_model):
    model = tiny_model
    rot = calibrate(model, SPEC, [torch.randint(0, len(tokenizer), (2, 48), generator=torch.Generator().manual_seed(0))])
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
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == _reference(model, rot, prompt, 24)
    for pool in (llm.engine.block_manager.window_pool, llm.engine.block_manager.quant_pool):
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_pages


def test_bf16_mode_serves_the_plain_model(setup):
    tokenizer, model, _ = setup
    bf16 = CompressionSpec.from_dict({"kv_cache": {"bits": 16, "page_size": 4}, "key": {"rotation": "none"},
                                      "value": {"rotation": "none"}})
    config = EngineConfig(num_window_pages=4, num_quant_pages=64, max_num_batched_tokens=256)
    llm = LLM(copy.deepcopy(model), spec=bf16, tokenizer=tokenizer, config=config)
    prompt = _prompts(len(tokenizer), [12], seed=3)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.token_ids == expected[0, len(prompt):].tolist()


def test_prefix_cache_hits_equal_misses_with_the_int2_runner(setup):
    """Sink pages are shared between requests with a common prefix; outputs do not change."""
    tokenizer, model, rot = setup
    shared = _prompts(len(tokenizer), [20], seed=7)[0]
    prompts = [shared + tail for tail in _prompts(len(tokenizer), [6, 11, 3], seed=8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        config = EngineConfig(num_window_pages=64, num_quant_pages=64, max_num_batched_tokens=256,
                              enable_prefix_caching=caching)
        llm = LLM(copy.deepcopy(model), spec=SPEC, rotations=rot, tokenizer=tokenizer, config=config)
        outputs[caching] = [o.token_ids for o in llm.generate(prompts, params)]
        # run the prompts again: now every one finds its prefix cached (when caching is on)
        assert [o.token_ids for o in llm.generate(prompts, params)] == outputs[caching]
        if caching:
            assert llm.engine.block_manager.num_prefix_hit_tokens >= SPEC.kv_cache.sink_tokens
    assert outputs[True] == outputs[False]
