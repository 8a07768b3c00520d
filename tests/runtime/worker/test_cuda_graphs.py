"""Decode steps replayed from CUDA graphs give what eager launches give (GPU only)."""
import pytest
import torch

from oscar_compile import CompressionSpec
from oscar_compile.runtime import LLM, SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# head_dim 64 at 2 bits packs 16-byte rows: the Triton kernels' smallest tile (no reference fallback)
SPEC = CompressionSpec.from_dict({
    "kv_cache": {"bits": 2, "group_size": 64, "sink_tokens": 16, "recent_tokens": 32},
    "key": {"rotation": "hadamard"}, "value": {"rotation": "hadamard"},
})
BF16 = CompressionSpec.from_dict({"kv_cache": {"bits": 16}, "key": {"rotation": "none"},
                                  "value": {"rotation": "none"}})


def _model(vocab_size: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.3, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval().to("cuda", torch.bfloat16)


def _generate(tokenizer, spec, prompts, cuda_graphs: bool, max_tokens=40, overlap=True, params=None, **config):
    # max_model_len 256: graphs plan the kernels for full-width page tables (256 tokens), eager
    # launches for the batch's longest; both stay below the first history split (4 blocks of 64
    # tokens), so they launch the same kernels, and float results can be compared bitwise
    config = EngineConfig(**{"max_num_batched_tokens": 1024, **config}, max_model_len=256, cuda_graphs=cuda_graphs,
                          overlap_steps=overlap)
    llm = LLM(_model(len(tokenizer)), spec=spec, tokenizer=tokenizer, config=config)
    assert llm.engine.overlap is overlap
    params = params or SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", [SPEC, BF16], ids=["int2", "bf16"])
def test_a_prompt_gives_the_same_tokens_in_any_batch_row(tokenizer, spec):
    """The prompt of row 0 repeated in row 1 of a batch of 8, and run alone: the same tokens. (The
    Triton kernels once read the chunk's values with the keys' row stride, which differs for the
    merged q/k/v projection: only the first token of a step was right.)"""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (5, 17, 30, 64, 70, 9, 100, 41)]
    prompts[1] = prompts[0]
    _, batched = _generate(tokenizer, spec, prompts, cuda_graphs=True, max_tokens=12)
    _, alone = _generate(tokenizer, spec, prompts[:1], cuda_graphs=True, max_tokens=12)
    assert batched[1] == batched[0] == alone[0]


@pytest.mark.parametrize("spec", [SPEC, BF16], ids=["int2", "bf16"])
def test_overlapped_steps_equal_plain_steps_on_the_gpu(tokenizer, spec):
    """Tokens taken from the device by graph replays and eager steps, seeded sampling and a stop
    token (one discarded step) included: the same tokens as stepping one step at a time."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (5, 17, 30, 64, 70, 9, 100, 41)]
    prompts[1] = prompts[0]
    _, free = _generate(tokenizer, spec, prompts, cuda_graphs=True, overlap=False)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[free[0][7]]),  # row 1 stops
              SamplingParams(max_tokens=30, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True)]
    params = [params[i % 3] for i in range(len(prompts))]
    llm, overlapped = _generate(tokenizer, spec, prompts, cuda_graphs=True, params=params)
    _, plain = _generate(tokenizer, spec, prompts, cuda_graphs=True, overlap=False, params=params)
    assert overlapped == plain and len(plain[1]) <= 8 and plain[1][-1] == free[0][7]
    pools = (llm.engine.page_manager.window_pool, llm.engine.page_manager.quant_pool)
    assert all(pool.num_used == 0 for pool in pools)


@pytest.mark.parametrize("spec", [SPEC, BF16], ids=["int2", "bf16"])
def test_graph_replay_equals_eager_decoding(tokenizer, spec):
    g = torch.Generator().manual_seed(3)
    # 8 sequences: a captured size, so the GEMMs see the same rows either way (bitwise equal)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (5, 17, 30, 64, 70, 9, 100, 41)]
    llm, graphed = _generate(tokenizer, spec, prompts, cuda_graphs=True)
    assert 8 in llm.engine.runner.graphs.graphs  # every size up to max_num_seqs was captured
    _, eager = _generate(tokenizer, spec, prompts, cuda_graphs=False)
    assert graphed == eager
    pools = (llm.engine.page_manager.window_pool, llm.engine.page_manager.quant_pool)
    assert all(pool.num_used == 0 for pool in pools)


def test_padded_graph_rows_leave_real_sequences_alone(tokenizer):
    """5 sequences replay the graph of 8: the 3 padding rows write only the scratch pages."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (6, 80, 33, 12, 57)]
    llm, graphed = _generate(tokenizer, SPEC, prompts, cuda_graphs=True)
    assert set(llm.engine.runner.graphs.graphs) >= {8}
    _, eager = _generate(tokenizer, SPEC, prompts, cuda_graphs=False)
    # cuBLAS may pick another GEMM for 8 rows than for 5, so logits can differ in the last bits:
    # compare token agreement, not bitwise equality; corrupted pages would derail whole sequences
    agree = (sum(a == b for x, y in zip(graphed, eager, strict=True) for a, b in zip(x, y, strict=True))
             / sum(map(len, eager)))
    assert agree > 0.9
    assert [x[:4] for x in graphed] == [y[:4] for y in eager]


def test_decode_consistent_prefill_runs_on_the_gpu(tokenizer):
    """--prefill-semantics decode-consistent on CUDA (the Triton kernel; decode steps in captured
    graphs run the graph's own ops, the one-token case, with no host read in the capture): the
    graphs are captured, and a prompt's logprobs served in chunks of 16 tokens agree with the whole
    prompt's (mean difference 0.1: bf16 logits of a 0.3-initialised model, other GEMM shapes and
    float orders; kernel exactness: tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py)."""
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, len(tokenizer), (150,), generator=g).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    rows = []
    for budget in (1024, 16):
        config = EngineConfig(max_num_batched_tokens=budget, max_model_len=256, prefill_semantics="decode-consistent")
        llm = LLM(_model(len(tokenizer)), spec=SPEC, tokenizer=tokenizer, config=config)
        assert llm.engine.runner.graphs.graphs  # captured: not fallen back to eager decoding
        (request,) = llm.generate([prompt], params)
        assert len(request.outputs[0].token_ids) == 4
        rows.append(torch.tensor([e.logprob for e in request.prompt_logprobs[1:]]))
    assert rows[0].isfinite().all() and (rows[1] - rows[0]).abs().mean() < 0.1


@pytest.mark.parametrize("spec", [SPEC, BF16], ids=["int2", "bf16"])
def test_piecewise_graphs_run_mixed_steps(tokenizer, spec):
    """Chunks of a 48-token budget beside decode rows replay the piecewise graphs (captured at
    start for 16, 32 and 48 tokens) and give the tokens of eager steps. Padded token counts may
    change cuBLAS's GEMMs, so tokens are compared for agreement, as for padded decode graphs; the
    bookkeeping is checked exactly on the CPU (test_piecewise_graphs.py)."""
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (70, 5, 33, 100, 12, 57)]
    config = EngineConfig(max_num_batched_tokens=48, max_model_len=256)
    llm = LLM(_model(len(tokenizer)), spec=spec, tokenizer=tokenizer, config=config)
    piecewise = llm.engine.runner.piecewise
    assert sorted(piecewise.graphs) == [16, 32, 48]
    replays = []
    run = piecewise.run
    piecewise.run = lambda batch, pending=None: replays.append(batch.num_tokens) or run(batch, pending)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    graphed = [o.outputs[0].token_ids for o in outs]
    assert len(replays) >= 5 and max(replays) == 48
    _, eager = _generate(tokenizer, spec, prompts, cuda_graphs=True, max_num_batched_tokens=48,
                         piecewise_max_tokens=0)
    agree = (sum(a == b for x, y in zip(graphed, eager, strict=True) for a, b in zip(x, y, strict=True))
             / sum(map(len, eager)))
    assert agree > 0.9 and [x[:4] for x in graphed] == [y[:4] for y in eager]


def test_a_failed_piecewise_capture_falls_back_to_eager_steps(tokenizer, monkeypatch):
    """A failure inside a piecewise capture (an 8192-token capture ran out of memory on an H100,
    bench/results/2026-12-05-gpu-int2-prefill-end-to-end call 16) ends the capture: no graph is
    kept, the stream is not left capturing (``empty_cache`` and later launches work), and mixed
    steps run eagerly and give eager tokens."""
    from oscar_compile.runtime.worker import piecewise_graphs

    calls = []
    outputs = piecewise_graphs._CaptureCache.oscar_layer_outputs

    def fail_in_the_second_piece(self, layer_idx, out, q):
        if self.pieces is not None:
            calls.append(layer_idx)
            raise torch.cuda.OutOfMemoryError("a capture that runs out of memory (test)")
        return outputs(self, layer_idx, out, q)

    monkeypatch.setattr(piecewise_graphs._CaptureCache, "oscar_layer_outputs", fail_in_the_second_piece)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, len(tokenizer), (n,), generator=g).tolist() for n in (70, 5, 33)]
    llm, failed = _generate(tokenizer, SPEC, prompts, cuda_graphs=True, max_num_batched_tokens=48, max_tokens=8)
    assert calls and llm.engine.runner.piecewise.graphs == {}
    assert not torch.cuda.is_current_stream_capturing()
    torch.cuda.empty_cache()  # raised cudaErrorStreamCaptureUnsupported while the capture stayed open
    monkeypatch.undo()
    _, eager = _generate(tokenizer, SPEC, prompts, cuda_graphs=True, max_num_batched_tokens=48, max_tokens=8,
                         piecewise_max_tokens=0)
    assert failed == eager
