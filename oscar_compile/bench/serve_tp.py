"""Decode and capacity rows of ``python -m oscar_compile.bench.serve`` with the model split over N ranks.

    python -m oscar_compile.bench.serve --shapes 8b --tensor-parallel-size 1 2 --parts decode capacity \\
        --contexts 8192 32768 131072 --capacity-contexts 100000 --kv-memory 80 --out serve_tp.json

Every rank runs the same benchmark code on its own slice (SPMD, no step messages: the batches are
synthetic and the same everywhere; ``bench.serve.split_model_rows`` is that code): the
random-weight model of the shape (the same seed on every rank, so the slices are slices of one
model) is split by ``tensor_parallel.shard`` before ``apply``, and each rank's
``CompressedRunner`` holds its ``H_kv / N`` KV heads' pages. The
row-wise projections' all-reduces keep the ranks in step; rank 0's rows are the result. The
KV budget (``--kv-memory``, else 85 % of the free memory) is per GPU, the smallest over the
ranks, so the capacity rows show how many more sequences N GPUs hold. The step breakdown's
``all_reduce`` share is the NCCL kernels' time (gloo's on a CPU), waiting for the slower rank
included: what the all-reduces cost a step.
"""
from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist


def run_on_ranks(rank_rows: Callable, args, world_size: int, max_len: int) -> dict[str, list[dict]]:
    """``rank_rows(rank, world_size, group, device, args, max_len)`` on every rank (ranks 1..
    spawned here, each on ``cuda:rank`` or the CPU, joined in one process group); rank 0's rows,
    each tagged with ``tensor_parallel_size``. ``rank_rows`` must be a module-level function."""
    from oscar_compile.tensor_parallel.launch import free_port

    device_type = _device_type(args)
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs, torch sees "
                         f"{torch.cuda.device_count()}")
    port = free_port()
    context = torch.multiprocessing.get_context("spawn")
    others = [context.Process(target=_follow, args=(rank_rows, rank, world_size, port, args, max_len), daemon=True)
              for rank in range(1, world_size)]
    for process in others:
        process.start()
    try:
        def find_dead_rank():  # a rank that fails to start fails the run at once
            return next((f"rank {rank} exited with code {p.exitcode}" for rank, p in enumerate(others, start=1)
                         if p.exitcode is not None), None)

        rows = _on_rank(rank_rows, 0, world_size, port, args, max_len, find_dead_rank)
    finally:
        for process in others:
            process.join(60)
            if process.exitcode is None:
                process.terminate()
    return {part: [dict(row, tensor_parallel_size=world_size) for row in part_rows] for part, part_rows in rows.items()}


def _follow(rank_rows: Callable, rank: int, world_size: int, port: int, args, max_len: int) -> None:
    sys.stdout = open(os.devnull, "w")  # rank 0 prints the rows
    _on_rank(rank_rows, rank, world_size, port, args, max_len)


def _device_type(args) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(args.device).type


def _on_rank(rank_rows: Callable, rank: int, world_size: int, port: int, args, max_len: int,
             find_dead_rank: Callable[[], str | None] = lambda: None) -> dict:
    from oscar_compile.tensor_parallel.launch import join_group

    device_type = _device_type(args)
    ranks = join_group(rank, world_size, port, device_type, timeout_s=600.0, find_dead_rank=find_dead_rank)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    try:
        return rank_rows(rank, world_size, ranks.data_group, device, args, max_len)
    finally:
        gc.collect()
        dist.destroy_process_group()


def smallest(value: int, device: torch.device, group) -> int:
    """The smallest ``value`` over the ranks: every rank must run the same batches."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
