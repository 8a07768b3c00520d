"""Prefill and swapping, timed through the real engine (``bench.serve --parts ttft swap``).

- ``ttft``: time to first token of one prompt of each ``--ttft-contexts`` length, prefilled in
  chunks of ``--max-num-batched-tokens``, by four engines (``ENGINES``) on the same model:

  - ``exact+staging``: prompt-exact prefill with deferred demotion (staging pages), with the
    staging pages the run used at most, in bytes;
  - ``exact``: prompt-exact prefill without staging, the old chunked prefill
    (``prefill_staging_memory_gb=0``: later chunks read earlier ones quantized);
  - ``consistent``: decode-consistent prefill (the runtime's default), prefix caching off: a miss.
    It stages nothing; ``staging_saved_bytes`` is the staging peak of ``exact+staging`` at the
    same context;
  - ``consistent+cache``: decode-consistent prefill with prefix caching and exact hits at BF16
    window snapshots (``prefix_hits="snapshot"``, runtime/core/window_snapshots.py). The prompt
    is sent once (``miss``), then again (``resend``: a hit at the snapshot at the prompt's last
    page boundary), then with its last ``--ttft-new-tokens`` tokens replaced (``follow-up``: the
    same document with a new question; a hit at the last periodic snapshot inside the shared
    prefix). Each row has its cached prompt tokens and ``miss_over_hit``; the snapshots taken for
    the context and their bytes (none are evicted: the pools hold them all).

  ``ttft_vs_old``: a row's TTFT over the old chunked prefill's (``exact``) at the same context.
  Then the runtime's BF16 mode (``bf16.yaml``: paged full-precision attention, no quantization)
  on its own random model of the same shape (``bf16_rows``, engine ``bf16-mode``, a
  miss), and ``ttft_vs_bf16``: each INT2 row's TTFT over the BF16 mode's at the same context
  (the prefill issue's goal: at most 1.15 for the default, ``consistent+cache``).
- ``swap``: the time to swap one ``--swap-context``-token sequence out to pinned host memory and
  back in (its window and history pages, every layer), against the time to recompute it (its
  TTFT with staging, what a recomputing preemption costs).

INT2 mode (``hadamard-int2``), random weights of the chosen shape, one sequence at a time, CUDA
graphs off (prefill steps never replay them). Each engine first serves a short warm-up request
(the prefix-caching one twice: a miss and a hit), so kernel compilation is not timed.
"""
from __future__ import annotations

import gc
import time

import torch

from oscar_compile.bench.e2e import SpelledIdTokenizer
from oscar_compile.formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT
from oscar_compile.runtime.core.page_manager import SwapCopy
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.window_snapshots import default_interval
from oscar_compile.runtime.engine_config import EngineConfig, build_engine
from oscar_compile.runtime.worker.compressed_runner import runner_factory

# the engines of the ttft rows: name -> (prefill semantics, staging pages, prefix caching)
ENGINES = {
    "exact+staging": (PROMPT_EXACT, True, False),
    "exact": (PROMPT_EXACT, False, False),
    "consistent": (DECODE_CONSISTENT, False, False),
    "consistent+cache": (DECODE_CONSISTENT, False, True),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_engine(compressed, layout, max_len: int, budget: int, staging: bool, swap_bytes: int = 0,
                prefill_semantics: str = PROMPT_EXACT, prefix_caching: bool = False):
    """An engine whose pools hold one sequence of ``max_len`` tokens (and staging for it). With
    ``prefix_caching`` (decode-consistent: snapshot hits) they hold two, the cached prefix of one
    beside the running other, and the window snapshots of two prompts of ``max_len`` tokens."""
    num_window, num_quant = layout.num_pages_for_seq(max_len)
    if prefix_caching:
        num_snapshots = 2 * (max_len // default_interval(layout) + 1) + 1  # periodic, prompt ends, warm-up
        num_window, num_quant = 2 * num_window + num_snapshots * (layout.recent // layout.page_size), 2 * num_quant
    config = EngineConfig(num_window_pages=num_window, num_quant_pages=num_quant + 1, max_num_seqs=1,
                          max_num_batched_tokens=budget, max_model_len=max_len, cuda_graphs=False,
                          enable_prefix_caching=prefix_caching, prefill_staging_memory_gb=None if staging else 0,
                          swap_space_gb=swap_bytes / 1024**3, layout=layout, prefill_semantics=prefill_semantics)
    vocab = compressed.model.config.get_text_config().vocab_size
    return build_engine(compressed.model, SpelledIdTokenizer(vocab), config,
                        make_runner=runner_factory(compressed, layout, config))


def random_prompt(num_tokens: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (num_tokens,), generator=g).tolist()


def first_token(engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token of ``prompt``, how many of its tokens the prefix cache gave)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    device = engine.runner.device
    _sync(device)
    start = time.perf_counter()
    engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    _sync(device)
    seconds = time.perf_counter() - start
    return seconds, max((out.num_cached_prompt_tokens for out in outputs), default=0)


def time_to_first_token_s(engine, num_tokens: int, vocab: int, seed: int = 0) -> float:
    return first_token(engine, random_prompt(num_tokens, vocab, seed))[0]


def ttft_rows(compressed, layout, shape: str, contexts: list[int], budget: int, vocab: int,
              num_new_tokens: int = 512, engines: list[str] | None = None) -> list[dict]:
    """The rows of every engine of ``ENGINES`` (or of ``engines``) at every context (module docstring)."""
    rows = []
    max_len = max(contexts) + 1
    for name in engines or ENGINES:
        semantics, staging, prefix_caching = ENGINES[name]
        engine = make_engine(compressed, layout, max_len, budget, staging, prefill_semantics=semantics,
                             prefix_caching=prefix_caching)
        warm_up = random_prompt(min(2 * budget + 1, max_len - 1), vocab, seed=99)
        for _ in range(2 if prefix_caching else 1):  # the second: a hit, which restores a snapshot
            first_token(engine, warm_up)
        for context in contexts:
            base = dict(shape=shape, context=context, chunk=budget, engine=name, prefill_semantics=semantics,
                        deferred_demotion=staging, prefix_caching=prefix_caching)
            new = _prefix_hit_rows(engine, context, vocab, num_new_tokens) if prefix_caching else \
                [_miss_row(engine, context, vocab)]
            for row in new:
                row = {**base, **row}
                print(row, flush=True)
                rows.append(row)
        _release(engine)
    _compare(rows)
    return rows


def bf16_rows(compressed, layout, shape: str, contexts: list[int], budget: int, vocab: int) -> list[dict]:
    """The BF16 mode's miss at every context (``compressed``: a model rewritten with bf16.yaml)."""
    engine = make_engine(compressed, layout, max(contexts) + 1, budget, staging=False)
    first_token(engine, random_prompt(min(2 * budget + 1, max(contexts)), vocab, seed=99))  # warm-up
    rows = []
    for context in contexts:
        row = dict(shape=shape, context=context, chunk=budget, engine="bf16-mode", prefill_semantics=None,
                   deferred_demotion=False, prefix_caching=False, **_miss_row(engine, context, vocab))
        print(row, flush=True)
        rows.append(row)
    _release(engine)
    return rows


def compare_with_bf16(rows: list[dict]) -> None:
    """``ttft_vs_bf16`` on every row, where the BF16 mode's miss at the same context exists."""
    bf16 = {r["context"]: r["ttft_s"] for r in rows if r["engine"] == "bf16-mode"}
    for row in rows:
        if row["context"] in bf16:
            row["ttft_vs_bf16"] = row["ttft_s"] / bf16[row["context"]]


def _miss_row(engine, context: int, vocab: int) -> dict:
    bm, layout = engine.page_manager, engine.page_manager.layout
    bm.peak_staging_pages = 0
    ttft, cached = first_token(engine, random_prompt(context, vocab))
    return dict(request="miss", num_cached_prompt_tokens=cached, ttft_s=ttft,
                staging_peak_bytes=bm.peak_staging_pages * layout.window_page_bytes,
                staging_pool_bytes=bm.staging_pool.num_pages * layout.window_page_bytes)


def _prefix_hit_rows(engine, context: int, vocab: int, num_new_tokens: int) -> list[dict]:
    """A miss, the same prompt again, and the prompt with its last ``num_new_tokens`` replaced."""
    bm = engine.page_manager
    for pool in (bm.window_pool, bm.quant_pool):  # the earlier contexts' prompts and snapshots
        pool.reset_prefix_cache()
    prompt = random_prompt(context, vocab)
    num_new = min(num_new_tokens, context - 1)
    follow_up = prompt[: context - num_new] + random_prompt(num_new, vocab, seed=1)
    before = engine.stats()
    rows = [_miss_row(engine, context, vocab)]
    for request, tokens in (("resend", prompt), ("follow-up", follow_up)):
        ttft, cached = first_token(engine, tokens)
        rows.append(dict(rows[0], request=request, num_cached_prompt_tokens=cached, ttft_s=ttft,
                         miss_over_hit=rows[0]["ttft_s"] / ttft))
    after = engine.stats()
    taken = after.window_snapshots_taken - before.window_snapshots_taken
    for row in rows:  # the context's three requests together (none evicted: the pools hold them all)
        row.update(window_snapshots_taken=taken,
                   window_snapshot_hits=after.window_snapshot_hits - before.window_snapshot_hits,
                   snapshot_bytes=taken * bm.snapshots.snapshot_bytes)
    return rows


def _compare(rows: list[dict]) -> None:
    """Each row against the old chunked prefill, and the staging decode-consistent prefill saves
    (where those engines ran: ``--ttft-engines`` may leave them out)."""
    for row in rows:
        same = [r for r in rows if r["context"] == row["context"] and r["request"] == "miss"]
        old = next((r for r in same if r["engine"] == "exact"), None)
        if old is not None:
            row["ttft_vs_old"] = row["ttft_s"] / old["ttft_s"]
        staged = next((r for r in same if r["engine"] == "exact+staging"), None)
        if row["prefill_semantics"] == DECODE_CONSISTENT and staged is not None:
            row["staging_saved_bytes"] = staged["staging_peak_bytes"] - row["staging_peak_bytes"]


def swap_rows(compressed, layout, shape: str, context: int, budget: int, vocab: int, reps: int) -> list[dict]:
    num_window, num_quant = layout.num_pages_for_seq(context)
    num_bytes = num_window * layout.window_page_bytes + num_quant * layout.quant_page_bytes
    engine = make_engine(compressed, layout, context + 1, budget, staging=True, swap_bytes=num_bytes + 2**20)
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
        print(f"\n{'shape':>5} {'context':>8} {'engine':>16} {'request':>9} {'cached':>8} {'TTFT s':>8} "
              f"{'vs old':>6} {'vs bf16':>7} {'miss/hit':>8} {'staging GiB':>11} {'saved GiB':>9}")
    ttft = sorted(result.get("ttft", []), key=lambda r: r["context"])  # the engines side by side
    for r in ttft:
        hit = f"{r['miss_over_hit']:>8.2f}" if "miss_over_hit" in r else f"{'-':>8}"
        saved = f"{r['staging_saved_bytes'] / 1024**3:>9.3f}" if "staging_saved_bytes" in r else f"{'-':>9}"
        old = f"{r['ttft_vs_old']:>6.3f}" if "ttft_vs_old" in r else f"{'-':>6}"
        vs_bf16 = f"{r['ttft_vs_bf16']:>7.3f}" if "ttft_vs_bf16" in r else f"{'-':>7}"
        print(f"{r['shape']:>5} {r['context']:>8} {r.get('engine', ''):>16} {r.get('request', 'miss'):>9} "
              f"{r.get('num_cached_prompt_tokens', 0):>8} {r['ttft_s']:>8.3f} {old} {vs_bf16} {hit} "
              f"{r['staging_peak_bytes'] / 1024**3:>11.3f} {saved}")
    for r in ttft:
        if r.get("request") == "miss" and "window_snapshots_taken" in r:
            print(f"{r['shape']:>5} {r['context']:>8}: {r['window_snapshots_taken']} window snapshots taken "
                  f"({r['snapshot_bytes'] / 1024**2:.1f} MiB), {r['window_snapshot_hits']} restored")
    if result.get("swap"):
        print(f"\n{'shape':>5} {'context':>8} {'GiB':>6} {'out ms':>8} {'in ms':>8} {'recompute ms':>12} {'share':>6}")
    for r in result.get("swap", []):
        print(f"{r['shape']:>5} {r['context']:>8} {r['bytes'] / 1024**3:>6.2f} {r['swap_out_ms']:>8.1f} "
              f"{r['swap_in_ms']:>8.1f} {r['recompute_ms']:>12.1f} {r['swap_share_of_recompute']:>6.3f}")
