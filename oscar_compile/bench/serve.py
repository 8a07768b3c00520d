"""Serving benchmark of the runtime (docs/design.md §8.3): decode steps, capacity, end-to-end generation; INT2 vs BF16.

    python -m oscar_compile.bench.serve [--shapes 8b 4b] [--contexts 8192 32768 131072]
        [--capacity-contexts 32768 100000] [--kv-memory GiB]
        [--e2e-batches 1 16 64] [--e2e-prompt 8192] [--e2e-output 256] [--compare-unfused] [--out bench.json]

A Qwen3-8B- (and 4B-) shaped model with random weights, rewritten by ``apply`` with an INT2 spec
(``hadamard-int2``: the same ops and cost as OSCAR, no calibration data needed) or with
``bf16.yaml`` (the runtime's BF16 mode, paged full-precision attention). Decode steps run the
real ``CompressedRunner`` on a synthetic batch whose caches are pre-filled to the context
(random page contents: speed does not depend on them):
1. batch-1 decode tokens/s at each context, INT2 vs BF16, replayed from CUDA graphs (and eager),
   with the step broken into GEMM, attention, cache write, rotation (with RoPE, fused), the fused
   norms / SiLU-product, and other by the torch profiler on eager steps (the same kernels; as the
   OSCAR paper's Table 8); ``--compare-unfused`` adds the same rows for models rewritten with
   ``apply(..., fuse=False)`` (Hugging Face's own RMSNorm, RoPE and MLP code), side by side;
2. the most sequences of each capacity context that fit the same KV budget, INT2 vs BF16, and the
   decode throughput of that full batch;
3. (``--e2e-batches``, first shape only) prompts of ``--e2e-prompt`` random tokens generating
   ``--e2e-output`` tokens through the whole runtime, INT2 and BF16 mode, against transformers'
   continuous batching (``generate_batch``) on the same model (see ``oscar_compile.bench.e2e``).
4. (``--parts ttft swap``, first shape only, INT2; ttft also the BF16 mode) time to first token
   of ``--ttft-contexts`` prompts: prompt-exact prefill with deferred demotion (and its peak staging memory) and without
   (the old chunked prefill), decode-consistent prefill (no staging: the memory it saves), and
   decode-consistent prefix hits at window snapshots (the same prompt again, and one whose last
   ``--ttft-new-tokens`` differ) against the miss; the time to swap a ``--swap-context``-token
   sequence out to host memory and back against recomputing it (see ``oscar_compile.bench.prefill_swap``).
5. (``--parts structured``, first shape only, INT2) the cost of structured output: a batch of
   ``--structured-batch`` decoding under a ~10-field JSON schema against the same batch
   unconstrained, with a 151,936-token tokenizer; mask time per step, compile time, TTFT (see
   ``oscar_compile.bench.structured``).
6. (``--tensor-parallel-size 1 2``) the decode and capacity rows with the model split over 2 GPUs
   beside the unsplit ones, each step's all-reduce time in the breakdown (``allred``); the KV
   budget is per GPU (see ``oscar_compile.bench.serve_tp``).
7. (``--parts steps``, first shape only) a prefill step of ``--max-num-batched-tokens`` tokens and a
   mixed step (that budget with ``--step-decodes`` decode rows) ending at each of ``--step-contexts``,
   INT2 against the BF16 mode, each step's largest kernels by device time (see
   ``oscar_compile.bench.serve_steps``).
``--deterministic`` runs every part in deterministic mode (issue 31: its cost against the default).
``--plan-ab`` adds to each decode row (``--decode-batches`` sets their batch sizes) eager steps with
the attention plan memoized per step against planned at every layer (issue #32: host time saved).
``--parts`` picks the sections (default: decode capacity e2e, the e2e rows only with
``--e2e-batches``). Prints tables and writes JSON. ``--shapes tiny --device cpu`` is the CPU
smoke run CI uses.
"""
from __future__ import annotations

import gc
import itertools
import statistics
import time

import torch

from oscar_compile.bench.serve_args import build_parser
from oscar_compile.bench.serve_models import (
    MODES,
    SHAPES,
    build_model,
    empty_cache,
    mode_spec,
    random_model,
    release,
    step_time_s,
    sync,
)
from oscar_compile.bench.serve_steps import steps_part
from oscar_compile.evaluation.result_file import save_json
from oscar_compile.kernels.determinism import LINEAR_RANGE, deterministic
from oscar_compile.runtime.worker.compressed_runner import CompressedRunner
from oscar_compile.runtime.worker.runner import Batch

GIB = 1024**3


def decode_batch(layout, batch_size: int, context: int) -> tuple[Batch, int, int]:
    """One decode step of ``batch_size`` sequences holding ``context`` tokens; (batch, window pages, quant pages)."""
    num_window, num_quant = layout.num_pages_for_seq(context + 1)
    seqs = range(batch_size)
    batch = Batch(
        seq_ids=list(seqs), token_ids=[[7] for _ in seqs], positions=[[context] for _ in seqs],
        cache_lens=[context] * batch_size,
        history_lens=[layout.num_history_tokens(context)] * batch_size,
        window_tables=[list(range(i * num_window, (i + 1) * num_window)) for i in seqs],
        quant_tables=[list(range(i * num_quant, (i + 1) * num_quant)) for i in seqs],
        context_token_ids=[[] for _ in seqs], layout=layout,
    )
    return batch, batch_size * num_window, batch_size * num_quant


_OPS = {
    "attention": ("oscar::attention", "oscar::attention_bf16"),
    "cache_write": ("oscar::cache_write", "oscar::cache_write_bf16"),
    "rotation": ("oscar::rope", "oscar::rotate"),  # fused, oscar::rope is RoPE and the rotation
    "norm_act": ("oscar::rms_norm", "oscar::silu_mul"),
}
_GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", LINEAR_RANGE)  # the last: deterministic mode's matmul
# tensor-parallel all-reduces: on CUDA the NCCL kernels (by name); on a CPU the calling thread's op
# (gloo's own events run on its threads, spanning the wait for the other rank: not step time)
_ALL_REDUCES = ("c10d::allreduce_",)


def _inside(event, names) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in names:
            return True
        parent = parent.cpu_parent
    return False


def step_breakdown(runner: CompressedRunner, batch: Batch, reps: int = 3) -> dict[str, float]:
    """Share of the steps' device time (CPU time on a CPU) per category, from the torch profiler.

    An oscar op counts with everything under it; a GEMM counts when no oscar op encloses it (the
    CPU references do matmuls of their own); "other" is the rest of the step. On CUDA the whole is
    the sum of the kernels' own events: each kernel also shows in its launching op's device time,
    so summing every event's self time would count it twice.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            runner.run(batch)
        sync(runner.device)
    ours = {name for names in _OPS.values() for name in names}
    totals = dict.fromkeys([*_OPS, "gemm", "all_reduce"], 0.0)  # all_reduce: tensor-parallel ranks (serve_tp.py)
    whole = 0.0
    for ev in prof.events():
        on_device = ev.device_type != DeviceType.CPU
        if cuda:
            whole += ev.device_time_total if on_device else 0.0
            if on_device:
                totals["all_reduce"] += ev.device_time_total if ev.name.lower().startswith("nccl") else 0.0
                continue
        else:
            whole += ev.self_cpu_time_total
            if ev.name in _ALL_REDUCES:
                totals["all_reduce"] += ev.cpu_time_total
        for category, names in _OPS.items():
            if ev.name in names and not _inside(ev, ours):
                totals[category] += ev.device_time_total if cuda else ev.cpu_time_total
        if ev.name in _GEMMS and not _inside(ev, ours):
            # the deterministic matmul's range launches Triton kernels: their time is its children's
            own = ev.name != LINEAR_RANGE
            if cuda:
                totals["gemm"] += ev.self_device_time_total if own else ev.device_time_total
            else:
                totals["gemm"] += ev.self_cpu_time_total if own else ev.cpu_time_total
    shares = {name: (t / whole if whole else 0.0) for name, t in totals.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def _runner(compressed, layout, batch: Batch, num_window: int, num_quant: int, context: int, graphs: bool):
    return CompressedRunner(compressed, layout, num_window, num_quant, max_seq_len=context + 1,
                            max_num_seqs=batch.num_seqs, max_num_batched_tokens=batch.num_tokens, cuda_graphs=graphs,
                            max_graph_batch=batch.num_seqs)


def _graph_covers(runner: CompressedRunner, batch: Batch) -> bool:
    """Whether the runner replays a CUDA graph for ``batch`` (else it launches eagerly)."""
    return runner.graphs is not None and runner.graphs.can_run(batch)


def plan_ab_ms(runner: CompressedRunner, batch: Batch, reps: int) -> dict:
    """Median eager step times with the attention plan memoized per step (the default) and with
    every ``oscar::attention`` call planning for itself (the runner's dispatch keeping no plan,
    ``max_plans = 0``), the two alternated step by step; their difference is the host time the
    per-step plan saves."""
    kept, times = runner.attention.max_plans, {"planned": [], "unplanned": []}
    try:
        for _ in range(reps + 1):
            for name, max_plans in (("planned", kept), ("unplanned", 0)):
                runner.attention.max_plans = max_plans  # (a planned step plans at its first layer)
                start = time.perf_counter()
                runner.run(batch)
                sync(runner.device)
                times[name].append(time.perf_counter() - start)
    finally:
        runner.attention.max_plans = kept
    planned, unplanned = (statistics.median(t[1:]) * 1e3 for t in times.values())  # (the first: warm-up)
    return dict(eager_planned_ms=planned, eager_unplanned_ms=unplanned, plan_saved_ms=unplanned - planned)


def decode_rows(compressed, layout, shape: str, mode: str, contexts: list[int], reps: int,
                plan_ab: bool = False, batch_sizes: tuple[int, ...] = (1,)) -> list[dict]:
    rows = []
    fused = bool(compressed.report.fused)
    for context, batch_size in itertools.product(contexts, batch_sizes):
        batch, num_window, num_quant = decode_batch(layout, batch_size, context)
        runner = _runner(compressed, layout, batch, num_window, num_quant, context, graphs=True)
        t = step_time_s(runner, batch, reps)
        row = dict(shape=shape, mode=mode, fused=fused, context=context, batch=batch_size, step_ms=t * 1e3,
                   tokens_per_s=batch_size / t, cuda_graphs=_graph_covers(runner, batch))
        if row["cuda_graphs"]:  # the profile's op attribution needs eager launches
            row["eager_step_ms"] = step_time_s(_eager(runner), batch, reps) * 1e3
        if plan_ab:
            row.update(plan_ab_ms(_eager(runner), batch, reps))
        row["breakdown"] = step_breakdown(_eager(runner), batch)
        print(row, flush=True)
        rows.append(row)
        release(runner)
    return rows


def _eager(runner: CompressedRunner) -> CompressedRunner:
    runner.graphs = None
    return runner


def capacity_rows(compressed, layout, shape: str, mode: str, contexts: list[int], budget: int, reps: int) -> list[dict]:
    rows = []
    for context in contexts:
        per_seq = _bytes_per_seq(layout, context)
        max_seqs = max(0, budget // per_seq)
        row = dict(shape=shape, mode=mode, context=context, kv_budget_gib=budget / GIB, bytes_per_seq=per_seq,
                   max_seqs=int(max_seqs))
        if max_seqs:
            batch, num_window, num_quant = decode_batch(layout, int(max_seqs), context)
            runner = _runner(compressed, layout, batch, num_window, num_quant, context, graphs=True)
            t = step_time_s(runner, batch, reps)
            row.update(step_ms=t * 1e3, tokens_per_s=max_seqs / t, cuda_graphs=_graph_covers(runner, batch))
            release(runner)
        print(row, flush=True)
        rows.append(row)
    return rows


def run(args) -> dict:
    """Every section, in order; the result so far is written to ``args.out`` after each row
    group, so a run stopped by a time limit still leaves what it measured."""
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    max_len = max(args.contexts + args.capacity_contexts + [args.e2e_prompt + args.e2e_output]
                  + (args.step_contexts if "steps" in args.parts else [])) + 1
    result = dict(device=_device_line(device), command=args.command, deterministic=args.deterministic, decode=[],
                  capacity=[], e2e=[])
    if "ttft" in args.parts or "swap" in args.parts:
        result.update(ttft=[], swap=[])
        _prefill_swap_parts(args, device, result)
    for size in (n for n in args.tensor_parallel_size if n != 1):  # decode and capacity rows over n ranks
        from oscar_compile.bench.serve_tp import run_on_ranks

        for part, rows in run_on_ranks(split_model_rows, args, size, max_len).items():
            result[part] += rows
        save_json(result, args.out)
    for shape in (args.shapes if 1 in args.tensor_parallel_size and set(args.parts) & {"decode", "capacity"} else []):
        for mode in MODES:
            compressed, layout = build_model(shape, mode, max_len, device)
            if "decode" in args.parts:
                result["decode"] += decode_rows(compressed, layout, shape, mode, args.contexts, args.reps, args.plan_ab,
                                                tuple(args.decode_batches))
                save_json(result, args.out)
            if args.capacity_contexts and "capacity" in args.parts:
                budget = int(args.kv_memory * GIB) if args.kv_memory else _free_memory_bytes(device)
                result["capacity"] += capacity_rows(compressed, layout, shape, mode, args.capacity_contexts, budget,
                                                    args.reps)
                save_json(result, args.out)
            del compressed
            gc.collect()
            empty_cache(device)
            if args.compare_unfused and "decode" in args.parts:
                compressed, layout = build_model(shape, mode, max_len, device, fuse=False)
                result["decode"] += decode_rows(compressed, layout, shape, mode, args.contexts, args.reps)
                save_json(result, args.out)
                del compressed
                gc.collect()
                empty_cache(device)
    if "structured" in args.parts:
        _structured_part(args, device, result)
    if "steps" in args.parts:
        steps_part(args, device, max_len, result)
    if args.e2e_batches and "e2e" in args.parts:
        from oscar_compile.bench.e2e import e2e_rows

        def keep(row: dict) -> None:
            print(row, flush=True)
            result["e2e"].append(row)
            save_json(result, args.out)

        shape = args.shapes[0]
        e2e_rows(lambda: random_model(shape, max_len, device), {m: mode_spec(shape, m) for m in MODES},
                 args.e2e_batches, args.e2e_prompt, args.e2e_output, args.e2e_kv_memory,
                 args.max_num_batched_tokens, args.e2e_time_limit, keep, args.e2e_systems)
    return result


def split_model_rows(rank: int, world_size: int, group, device: torch.device, args, max_len: int) -> dict:
    """One rank's decode and capacity rows with the model split over ``world_size`` ranks
    (``serve_tp.run_on_ranks`` runs it on every rank; the KV budget is the smallest per GPU)."""
    from oscar_compile.bench.serve_tp import smallest
    from oscar_compile.tensor_parallel.shard import shard_model

    rows: dict[str, list[dict]] = {"decode": [], "capacity": []}
    for shape in args.shapes:
        for mode in MODES:
            compressed, layout = build_model(shape, mode, max_len, device,
                                             prepare=lambda m: shard_model(m, rank, world_size, group))
            if "decode" in args.parts:
                rows["decode"] += decode_rows(compressed, layout, shape, mode, args.contexts, args.reps)
            if args.capacity_contexts and "capacity" in args.parts:
                budget = int(args.kv_memory * GIB) if args.kv_memory else _free_memory_bytes(device)
                rows["capacity"] += capacity_rows(compressed, layout, shape, mode, args.capacity_contexts,
                                                  smallest(budget, device, group), args.reps)
            del compressed
            gc.collect()
            empty_cache(device)
            if rank == 0:  # what was measured so far survives a time limit
                save_json(dict(rows, partial=True, tensor_parallel_size=world_size), args.out)
    return rows


def _prefill_swap_parts(args, device: torch.device, result: dict) -> None:
    from oscar_compile.bench import prefill_swap

    shape = args.shapes[0]
    parts = [p for p in ("ttft", "swap") if p in args.parts]
    max_len = max(([max(args.ttft_contexts)] if "ttft" in parts else [])
                  + ([args.swap_context] if "swap" in parts else [])) + 1
    compressed, layout = build_model(shape, "int2", max_len, device)
    vocab = compressed.model.config.vocab_size
    if "ttft" in parts:
        result["ttft"] += prefill_swap.ttft_rows(compressed, layout, shape, args.ttft_contexts,
                                                 args.max_num_batched_tokens, vocab, args.ttft_new_tokens,
                                                 engines=args.ttft_engines)
        save_json(result, args.out)
    if "swap" in parts:
        result["swap"] += prefill_swap.swap_rows(compressed, layout, shape, args.swap_context,
                                                 args.max_num_batched_tokens, vocab, args.reps)
        save_json(result, args.out)
    del compressed
    gc.collect()
    empty_cache(device)
    if "ttft" in parts:  # the BF16 mode's rows, on its own model (the INT2 one released first)
        compressed, layout = build_model(shape, "bf16", max_len, device)
        result["ttft"] += prefill_swap.bf16_rows(compressed, layout, shape, args.ttft_contexts,
                                                 args.max_num_batched_tokens, vocab)
        prefill_swap.compare_with_bf16(result["ttft"])
        save_json(result, args.out)
        del compressed
        gc.collect()
        empty_cache(device)


def _structured_part(args, device: torch.device, result: dict) -> None:
    from oscar_compile.bench import bpe_tokenizer, structured

    shape = args.shapes[0]
    max_len = args.structured_prompt + args.structured_output + 1
    model = random_model(shape, max_len, device, vocab_size=bpe_tokenizer.QWEN3_VOCAB_SIZE)
    kv_memory = args.e2e_kv_memory if device.type == "cuda" else None
    result["structured"] = structured.structured_rows(
        model, mode_spec(shape, "int2"), bpe_tokenizer.load(), shape, args.structured_batch, args.structured_prompt,
        args.structured_output, kv_memory, lambda: sync(device))
    save_json(result, args.out)
    del model
    gc.collect()
    empty_cache(device)


def _bytes_per_seq(layout, context: int) -> int:
    num_window, num_quant = layout.num_pages_for_seq(context + 1)
    return num_window * layout.window_page_bytes + num_quant * layout.quant_page_bytes


def _free_memory_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 * GIB
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * 0.85)


def _device_line(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}"
    return f"cpu; torch {torch.__version__}"


def print_tables(result: dict) -> None:
    print(result["device"])
    print(f"{'shape':>5} {'mode':>5} {'tp':>2} {'fused':>5} {'context':>8} {'ms/step':>9} {'tok/s':>8}  "
          "gemm attn write rot norm allred other")
    for r in result["decode"]:
        b = r["breakdown"]
        print(f"{r['shape']:>5} {r['mode']:>5} {r.get('tensor_parallel_size', 1):>2} "
              f"{'yes' if r['fused'] else 'no':>5} "
              f"{r['context']:>8} {r['step_ms']:>9.2f} {r['tokens_per_s']:>8.1f}  {b['gemm']:.2f} {b['attention']:.2f} "
              f"{b['cache_write']:.2f} {b['rotation']:.2f} {b['norm_act']:.2f} {b['all_reduce']:>6.2f} "
              f"{b['other']:.2f}")
    if result["capacity"]:
        print(f"\n{'shape':>5} {'mode':>5} {'tp':>2} {'context':>8} {'max seqs':>8} {'tok/s':>9}")
    for c in result["capacity"]:
        print(f"{c['shape']:>5} {c['mode']:>5} {c.get('tensor_parallel_size', 1):>2} {c['context']:>8} "
              f"{c['max_seqs']:>8} "
              f"{c.get('tokens_per_s', 0):>9.1f}")
    if result.get("ttft") or result.get("swap"):
        from oscar_compile.bench.prefill_swap import print_tables as print_prefill_swap

        print_prefill_swap(result)
    if result.get("structured"):
        from oscar_compile.bench.structured import print_rows

        print_rows(result["structured"])
    if result["e2e"]:
        print(f"\n{'system':>16} {'batch':>5} {'tok/s':>9} {'user tok/s':>10} {'host %':>6} "
              f"{'prefill ms':>10} {'mixed ms':>8} {'mixed host %':>12} {'mixed gap ms':>12}  note")
    nan = float("nan")
    for e in result["e2e"]:
        note = e.get("error") or e.get("skipped") or ""
        host = e.get("host_share_of_decode_step")
        prefill, mixed = e.get("prefill_steps") or {}, e.get("mixed_steps") or {}
        mixed_host = mixed.get("host_over_forward")
        print(f"{e['system']:>16} {e['batch']:>5} {e.get('tokens_per_s') or 0:>9.1f} "
              f"{e.get('per_user_tokens_per_s') or 0:>10.1f} "
              f"{100 * host if host is not None else nan:>6.1f} {prefill.get('forward_ms_median') or nan:>10.1f} "
              f"{mixed.get('forward_ms_median') or nan:>8.1f} {100 * mixed_host if mixed_host else nan:>12.1f} "
              f"{mixed.get('device_gap_ms_median') or nan:>12.2f}  {note}")


def main(argv=None) -> int:
    parser = build_parser(__doc__.split("\n")[0], sorted(SHAPES))
    args = parser.parse_args(argv)
    args.command = "python -m oscar_compile.bench.serve " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:])
    if any(n != 1 for n in args.tensor_parallel_size) and (set(args.parts) & {"ttft", "swap"} or args.e2e_batches):
        parser.error("--tensor-parallel-size above 1 runs the decode and capacity parts only")
    with deterministic(args.deterministic):  # the runners, their graph captures and steps run in this thread
        result = run(args)
    print_tables(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
