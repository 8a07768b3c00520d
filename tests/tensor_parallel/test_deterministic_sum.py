"""Deterministic mode's tensor-parallel sum: 4 gloo ranks on the CPU, each row summed in rank order
whatever the message size (1, 3 or 64 rows).

With 2 ranks a + b = b + a, so any order passes; with 4 the order of the three additions shows in
the last bits (the partials span many magnitudes), which the check against ``((p0 + p1) + p2) + p3``
computed locally catches. The row-wise projections' hook (shard._all_reduce_hook) takes this path
under ``deterministic()``.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

WORLD = 4


def _partial(rank: int, rows: int = 64, width: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(rows, width, generator=g) * torch.logspace(-4, 4, width)[None, :] * (rank + 1)


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from oscar_compile.kernels.determinism import deterministic
    from oscar_compile.tensor_parallel.shard import _all_reduce_hook

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        hook = _all_reduce_hook(None)
        mine = _partial(rank)
        with deterministic():
            results = {m: hook(None, (), mine[:m].clone()) for m in (1, 3, 64)}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_rows_sum_in_rank_order_for_every_message_size(tmp_path):
    torch.set_num_threads(1)
    mp.spawn(_rank_main, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    parts = [_partial(r) for r in range(WORLD)]
    expected = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    assert not torch.equal(expected, ((parts[3] + parts[2]) + parts[1]) + parts[0])  # the order shows
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for m, total in results.items():
            assert torch.equal(total, expected[:m]), (rank, m)
