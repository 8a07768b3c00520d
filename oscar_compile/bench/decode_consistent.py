"""Decode-consistent prefill benchmark: one Qwen3-8B layer (bench.kernel_setup), one sequence.

``python -m oscar_compile.bench.decode_consistent [--shapes 0:32768 30720:2048] [--out rows.json]``
prints one JSON row per ``cached:chunk`` shape (a chunk of ``chunk`` new tokens after ``cached``
ones; 0:32768 is a whole 32k prompt): ms per layer of

- ``decode_consistent_ms``: the Triton path as the caches run it
  (``cache.decode_consistent.triton_decode_consistent_attention``: the band pre-pass, then the
  paged kernel over the INT-b pages as stored);
- ``prompt_exact_ms``: ``oscar::attention`` on the same call (the prompt-exact semantics);

and ``peak_mib``, the memory the decode-consistent call allocates beyond what was held before
it. Timed with CUDA events around eager calls (the path reads lengths on the host: no CUDA
graph), median of ``reps``. Small shapes (chunk x (cached + chunk) <= 2^24) also report the
relative error against the reference, whose dense score matrix larger shapes could not hold.
"""

from __future__ import annotations

import argparse
import json

import torch

from oscar_compile.bench.kernel_setup import CLIPS, H_KV, H_Q, RECENT, SINK, D, chunk_args, time_ms
from oscar_compile.evaluation.result_file import save_json
from oscar_compile.kernels import ops

DEFAULT_SHAPES = ("0:4096", "0:16384", "0:32768", "30720:2048")


def bench_shape(cached: int, chunk: int, reps: int = 5, device: str = "cuda") -> dict:
    """One row (``device`` other than CUDA: a smoke test of this code under the interpreter)."""
    from oscar_compile.cache.decode_consistent import triton_decode_consistent_attention
    from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import attention_decode_consistent_ref

    dev = torch.device(device)
    args = chunk_args(cached, chunk, dev)
    dc_args = {**args, **CLIPS}

    row = {"cached": cached, "chunk": chunk, "H_q": H_Q, "H_kv": H_KV, "D": D, "sink": SINK, "recent": RECENT}
    row["prompt_exact_ms"] = time_ms(lambda: ops.attention(**args), reps)
    row["decode_consistent_ms"] = time_ms(lambda: triton_decode_consistent_attention(**dc_args), reps)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated()
        triton_decode_consistent_attention(**dc_args)
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - held) / 2**20
    if chunk * (cached + chunk) <= 2**24:
        got = triton_decode_consistent_attention(**dc_args).float()
        want = attention_decode_consistent_ref(**dc_args).float()
        row["rel_err"] = ((got - want).norm() / want.norm()).item()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m oscar_compile.bench.decode_consistent", description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="cached:chunk pairs")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    rows = []
    for shape in args.shapes:
        cached, chunk = (int(x) for x in shape.split(":"))
        rows.append(bench_shape(cached, chunk, args.reps))
        print(json.dumps(rows[-1]), flush=True)
    save_json(rows, args.out)
    return rows


if __name__ == "__main__":
    main()
