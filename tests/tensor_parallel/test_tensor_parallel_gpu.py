"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs, the Triton / Gluon kernels): a random-weight
model of Qwen3-8B's widths (4096 hidden, 32 query / 8 KV heads of 128, 12288 MLP; 4 layers to
keep the files small) split over 2 ranks generates what it generates on one GPU, token for
token, in INT2 (hadamard-int2: no calibration data) and BF16 mode. Skipped without 2 GPUs."""
from __future__ import annotations

import pytest
import torch

from oscar_compile.bench.e2e import SpelledIdTokenizer  # token n is " tn": the model has no tokenizer files
from oscar_compile.runtime import LLM, EngineConfig, SamplingParams
from oscar_compile.spec import shipped_spec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    # a wide init spreads the logits, so bf16 rounding of the two ranks' partial sums cannot flip an argmax tie
    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=4, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                         initializer_range=0.2, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("qwen3-8b-widths")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("mode", ["hadamard-int2", "bf16"])
def test_two_gpus_generate_what_one_generates(model_dir, mode):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (700, 300, 1200, 40)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    config = EngineConfig(kv_memory_gb=4, max_num_seqs=4, max_num_batched_tokens=1024)
    spec = shipped_spec(mode)
    one = LLM(model_dir, spec, device="cuda", config=config, tokenizer=SpelledIdTokenizer(151936))
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    del one
    torch.cuda.empty_cache()
    with LLM(model_dir, spec, device="cuda", config=config, tokenizer=SpelledIdTokenizer(151936),
             tensor_parallel_size=2) as two:
        assert two.engine.runner.local.graphs is not None  # decode steps replayed CUDA graphs, all-reduce inside
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params)]
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, f"prompt {i}: the split model diverges at token {first}"


def test_every_rank_profiles_and_the_plan_fits_each(model_dir):
    """No kv_memory_gb: both ranks run the profile step in lockstep (runtime/core/memory_plan.py);
    the pages planned from the tighter rank fit on each, and the largest step (every token's
    logits: no prompt logprobs across ranks) runs without running out of memory."""
    share = 0.5
    config = EngineConfig(gpu_memory_utilization=share, max_num_seqs=8, max_num_batched_tokens=2048)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 151936, (n,), generator=gen).tolist() for n in (3000, 1500, 700, 40)]
    with LLM(model_dir, shipped_spec("hadamard-int2"), device="cuda", config=config,
             tokenizer=SpelledIdTokenizer(151936), tensor_parallel_size=2) as two:
        pools = two.engine.page_manager
        assert pools.max_seq_len() >= 4096  # one sequence of max_model_len fits, as the plan promised
        outs = two.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        free, total = torch.cuda.mem_get_info(0)  # rank 0's device: this process
        assert total - free <= share * total + 2**30  # within the share (plus the CUDA context, outside it)
