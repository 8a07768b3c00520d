"""Prompt-exact chunked prefill and swapping, timed through the real engine (``bench.serve --parts ttft swap``).

- ``ttft``: time to first token of one prompt of each ``--ttft-contexts`` length, prefilled in
  chunks of ``--max-num-batched-tokens``, with deferred demotion (staging pages, the default)
  against the old chunked prefill (``prefill_staging_memory_gb=0``: later chunks read earlier
  ones quantized); with the staging pages the run used at most, in bytes.
- ``swap``: the time to swap one ``--swap-context``-token sequence out to pinned host memory and
  back in (its window and history pages, every layer), against the time to recompute it (its
  TTFT with staging, what a recomputing preemption costs).

The engines run the prompt-exact prefill semantics (``EngineConfig.prefill_semantics``), whose
staging this measures; the default, decode-consistent, stages nothing.

INT2 mode (``hadamard-int2``), random weights of the chosen shape, one sequence at a time, CUDA
graphs off (prefill steps never replay them). Each engine first serves a short warm-up request,
so kernel compilation is not timed.
"""
from __future__ import annotations

import gc
import time

import torch

from oscar_compile.bench.e2e import SpelledIdTokenizer
from oscar_compile.formats.prefill import PROMPT_EXACT
from oscar_compile.runtime.core.page_manager import SwapCopy
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.engine_config import EngineConfig, build_engine
from oscar_compile.runtime.worker.compressed_runner import runner_factory


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_engine(model, layout, max_len: int, budget: int, staging: bool, swap_bytes: int = 0):
    """An engine whose pools hold one sequence of ``max_len`` tokens (and staging for it)."""
    num_window, num_quant = layout.num_pages_for_seq(max_len)
    config = EngineConfig(num_window_pages=num_window, num_quant_pages=num_quant + 1, max_num_seqs=1,
                          max_num_batched_tokens=budget, max_model_len=max_len, cuda_graphs=False,
                          enable_prefix_caching=False, prefill_staging_memory_gb=None if staging else 0,
                          swap_space_gb=swap_bytes / 1024**3, layout=layout, prefill_semantics=PROMPT_EXACT)
    vocab = model.config.get_text_config().vocab_size
    return build_engine(model, SpelledIdTokenizer(vocab), config, make_runner=runner_factory(model, layout, config))


def time_to_first_token_s(engine, num_tokens: int, vocab: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, vocab, (num_tokens,), generator=g).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    device = engine.runner.device
    _sync(device)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    _sync(device)
    return time.perf_counter() - start


def ttft_rows(model, layout, shape: str, contexts: list[int], budget: int, vocab: int) -> list[dict]:
    rows = []
    max_len = max(contexts) + 1
    for staging in (True, False):
        engine = make_engine(model, layout, max_len, budget, staging)
        time_to_first_token_s(engine, min(2 * budget + 1, max_len - 1), vocab, seed=99)  # warm-up
        bm = engine.page_manager
        for context in contexts:
            bm.peak_staging_pages = 0
            t = time_to_first_token_s(engine, context, vocab)
            row = dict(shape=shape, context=context, chunk=budget, deferred_demotion=staging, ttft_s=t,
                       staging_peak_bytes=bm.peak_staging_pages * layout.window_page_bytes,
                       staging_pool_bytes=bm.staging_pool.num_pages * layout.window_page_bytes)
            print(row, flush=True)
            rows.append(row)
        _release(engine)
    for row in rows:  # deferred demotion against the old chunked prefill, same context
        old = next(r for r in rows if r["context"] == row["context"] and not r["deferred_demotion"])
        row["ttft_vs_old"] = row["ttft_s"] / old["ttft_s"]
    return rows


def swap_rows(model, layout, shape: str, context: int, budget: int, vocab: int, reps: int) -> list[dict]:
    num_window, num_quant = layout.num_pages_for_seq(context)
    num_bytes = num_window * layout.window_page_bytes + num_quant * layout.quant_page_bytes
    engine = make_engine(model, layout, context + 1, budget, staging=True, swap_bytes=num_bytes + 2**20)
    time_to_first_token_s(engine, min(2 * budget + 1, context), vocab, seed=99)  # warm-up
    recompute = time_to_first_token_s(engine, context, vocab)
    runner = engine.runner
    copy = SwapCopy(0, tuple(range(num_window)), tuple(range(num_quant)))
    outs, ins = [], []
    for _ in range(reps + 1):  # the first pair warms up the copy path
        _sync(runner.device)
        start = time.perf_counter()
        runner.swap([copy], [])
        _sync(runner.device)
        middle = time.perf_counter()
        runner.swap([], [copy])
        _sync(runner.device)
        outs.append(middle - start)
        ins.append(time.perf_counter() - middle)
    out_s, in_s = sorted(outs[1:])[reps // 2], sorted(ins[1:])[reps // 2]
    row = dict(shape=shape, context=context, bytes=num_bytes, swap_out_ms=out_s * 1e3, swap_in_ms=in_s * 1e3,
               swap_gb_per_s=2 * num_bytes / (out_s + in_s) / 1e9, recompute_ms=recompute * 1e3,
               swap_share_of_recompute=(out_s + in_s) / recompute)
    print(row, flush=True)
    _release(engine)
    return [row]


def _release(engine) -> None:
    device = engine.runner.device
    engine.runner.pools = engine.runner.staging_pools = engine.runner.swapper = None
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_tables(result: dict) -> None:
    if result.get("ttft"):
        print(f"\n{'shape':>5} {'context':>8} {'deferred':>8} {'TTFT s':>8} {'vs old':>6} {'staging GiB':>11}")
    for r in result.get("ttft", []):
        print(f"{r['shape']:>5} {r['context']:>8} {'yes' if r['deferred_demotion'] else 'no':>8} {r['ttft_s']:>8.3f} "
              f"{r['ttft_vs_old']:>6.3f} {r['staging_peak_bytes'] / 1024**3:>11.3f}")
    if result.get("swap"):
        print(f"\n{'shape':>5} {'context':>8} {'GiB':>6} {'out ms':>8} {'in ms':>8} {'recompute ms':>12} {'share':>6}")
    for r in result.get("swap", []):
        print(f"{r['shape']:>5} {r['context']:>8} {r['bytes'] / 1024**3:>6.2f} {r['swap_out_ms']:>8.1f} "
              f"{r['swap_in_ms']:>8.1f} {r['recompute_ms']:>12.1f} {r['swap_share_of_recompute']:>6.3f}")
