"""``bench.serve --parts steps``: the runtime's prefill and mixed steps, INT2 against the BF16 mode.

End to end, INT2 wins through decode and memory only: its prefill does the BF16 mode's GEMMs and
more (rotations, the INT2 cache write, the decode-consistent attention over the INT2 history and the
band). At batch 32 of the prefill issue's workload (8192-token prompts and budget) INT2's
8192-token steps took 276 ms against 257 (H200, bench/results/2026-12-05-gpu-int2-prefill-end-to-end,
call 17), and that 8 % held the ratio at 1.085x of the 1.15x goal. These rows say where a step's
device time goes, per kernel (the torch profiler's device events by name: INT2's decode-consistent
attention and cache write are launched directly, under no ``oscar::`` op that
``serve.step_breakdown`` could attribute them to; on a CPU, self time per op), for the two shapes
of that run:

- ``prefill``: one chunk of the whole budget whose prompt ends at ``context`` (the first and only
  chunk when ``context`` equals the budget);
- ``mixed``: that chunk less ``decodes`` tokens beside ``decodes`` decode rows at ``context``.

Each step runs eagerly on garbage values (``memory_profile.profile_batch``), without prompt logits;
the median of ``reps`` steps after a warm-up that compiles the kernels. The chunk's row writes to
pages of its own (:func:`own_pages`): on the profile's one scratch page every token of the chunk
wrote the same words, and INT2's write, whose key bits are set by atomics, took 32 ms per 8192-token
step (H100, call 29 in bench/results/2026-12-07-gpu-int2-prefill-step) where its launch on distinct
pages takes 0.14 ms per layer (call a). The decode rows stay on the scratch pages, so their history
reads hit in L2: their attention is a lower bound.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections import defaultdict

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from oscar_compile.bench.serve_models import MODES, build_model, empty_cache, release, step_time_s, sync
from oscar_compile.evaluation.result_file import save_json
from oscar_compile.runtime.core.memory_plan import StepRow
from oscar_compile.runtime.worker.compressed_runner import CompressedRunner
from oscar_compile.runtime.worker.memory_profile import profile_batch


def step_shapes(budget: int, context: int, decodes: int) -> dict[str, list[StepRow]]:
    """The rows of the prefill and the mixed step (see the module docstring)."""
    if not 0 < budget <= context:
        raise ValueError(f"a chunk of the budget ({budget} tokens) must fit the context ({context})")
    if not 0 <= decodes < budget:
        raise ValueError(f"the mixed step's decode rows ({decodes}) must leave its chunk a token of the budget")
    chunk = budget - decodes
    return {"prefill": [StepRow(context - budget, budget)],
            "mixed": [StepRow(context - chunk, chunk)] + [StepRow(context - 1, 1)] * decodes}


def step_rows(compressed, layout, shape: str, mode: str, budget: int, contexts: list[int], decodes: int,
              reps: int) -> list[dict]:
    """One row per (context, step kind): ms per step and its largest kernels' ms (:func:`kernel_ms`)."""
    rows = []
    for context in contexts:
        for kind, shape_rows in step_shapes(budget, context, decodes).items():
            runner = CompressedRunner(compressed, layout, layout.num_window_pages_per_seq,
                                      math.ceil(context / layout.page_size) + 1, max_seq_len=context + 1,
                                      max_num_seqs=len(shape_rows), max_num_batched_tokens=budget, cuda_graphs=False)
            batch = dataclasses.replace(own_pages(profile_batch(runner, shape_rows)), logit_rows=())
            step_s = step_time_s(runner, batch, reps)
            row = dict(shape=shape, mode=mode, kind=kind, context=context, tokens=batch.num_tokens,
                       seqs=batch.num_seqs, step_ms=step_s * 1e3, kernels_ms=kernel_ms(runner, batch))
            print(row, flush=True)
            rows.append(row)
            release(runner)
    return rows


def own_pages(batch):
    """``batch`` with its first row (the chunk) on pages 0, 1, ... of both tables, the others left
    on the scratch pages: a runner built with a sequence's window pages and its context's quant
    pages holds them (the scratch pages come after)."""
    window = list(range(len(batch.window_tables[0])))
    quant = list(range(len(batch.quant_tables[0])))
    return dataclasses.replace(batch, window_tables=[window] + batch.window_tables[1:],
                               quant_tables=[quant] + batch.quant_tables[1:])


def kernel_ms(runner, batch, reps: int = 3, top: int = 20) -> dict[str, float]:
    """ms per step of the ``top`` largest: on CUDA each kernel name's device time, on a CPU each
    op's self time (``reps`` eager steps under the torch profiler; names cut at 90 characters)."""
    cuda = runner.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(reps):
            runner.run(batch)
        sync(runner.device)
    totals: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if not cuda:
            totals[ev.name[:90]] += ev.self_cpu_time_total
        elif ev.device_type != DeviceType.CPU:
            totals[ev.name[:90]] += ev.device_time_total
    largest = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {name: us / reps / 1e3 for name, us in largest}


def compare(rows: list[dict]) -> list[dict]:
    """INT2 against the BF16 mode per (context, kind): the step-time ratio and each kernel's ms in
    both (0 where it is not among a mode's largest)."""
    bf16 = {(r["context"], r["kind"]): r for r in rows if r["mode"] == "bf16"}
    pairs = []
    for row in rows:
        other = bf16.get((row["context"], row["kind"]))
        if row["mode"] != "int2" or other is None:
            continue
        kernels = {name: (row["kernels_ms"].get(name, 0.0), other["kernels_ms"].get(name, 0.0))
                   for name in {**row["kernels_ms"], **other["kernels_ms"]}}
        pairs.append(dict(context=row["context"], kind=row["kind"], int2_ms=row["step_ms"], bf16_ms=other["step_ms"],
                          ratio=row["step_ms"] / other["step_ms"], kernels_ms=kernels))
    return pairs


def print_comparison(pairs: list[dict]) -> None:
    for pair in pairs:
        print(f"{pair['kind']:>8} at {pair['context']}: INT2 {pair['int2_ms']:.1f} ms, BF16 {pair['bf16_ms']:.1f} ms "
              f"({pair['ratio']:.3f}x)", flush=True)
        print(f"    {'kernel (INT2 ms, BF16 ms, difference)':<90}", flush=True)
        for name, (a, b) in sorted(pair["kernels_ms"].items(), key=lambda kv: -abs(kv[1][0] - kv[1][1])):
            print(f"    {name:<90} {a:8.2f} {b:8.2f}  ({a - b:+.2f})", flush=True)


def steps_part(args, device, max_len: int, result: dict) -> None:
    """``--parts steps`` of ``bench.serve``: both modes' rows on the first shape, then the comparison."""
    shape, result["steps"] = args.shapes[0], []
    for mode in MODES:
        compressed, layout = build_model(shape, mode, max_len, device)
        result["steps"] += step_rows(compressed, layout, shape, mode, args.max_num_batched_tokens,
                                     args.step_contexts, args.step_decodes, args.reps)
        save_json(result, args.out)
        del compressed
        gc.collect()
        empty_cache(device)
    result["steps_int2_vs_bf16"] = compare(result["steps"])
    print_comparison(result["steps_int2_vs_bf16"])
    save_json(result, args.out)
