"""A window snapshot taken inside a chunk (runtime/worker/snapshot_takes.py) equals, bitwise, the
one a chunk ending at the boundary leaves (the ring pages copied after that chunk's write).

One layer's pools filled with random garbage first (pages are not zeroed when taken: the slots of
a ring not yet full hold whatever was there, and a snapshot copies them too), S0 = 4, W = 8,
P = 4, keys and values in float32 written into bf16 windows (the write rounds them). The writes
are ``cache_write_ref``'s, the op's CPU path. Boundaries at page boundaries and inside pages, next
to the chunk's start and its end, in a ring that wrapped, with the chunk starting in the sink, and
with the window at the boundary wholly inside the chunk. Each case also checks that the ring after
the chunk's write is not the snapshot: taking it after the write would fail the test.
"""

from __future__ import annotations

import pytest
import torch

from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.pools import allocate_layer_pools
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.page_records import SnapshotTake
from oscar_compile.runtime.worker.runner import Batch
from oscar_compile.runtime.worker.snapshot_takes import StepSnapshotTakes

S0, W, P, H, D = 4, 8, 4, 2, 16
LAYOUT = CacheLayout.uniform(num_layers=1, num_kv_heads=H, head_dim=D, page_size=P, group_size=16, sink=S0, recent=W)
FMT = LAYOUT.format_of(0)
WINDOW = [0, 1, 2]  # the sink page, then the ring's two pages
QUANT = list(range(20))
SNAPSHOT = [5, 6]  # window pages the snapshot goes to
OTHER_WINDOW, OTHER_QUANT = [7, 8, 9], [30, 31]  # a one-token row before the snapshot's row
CLIP = 0.96


def _pools(seed: int):
    g = torch.Generator().manual_seed(seed)
    pools = allocate_layer_pools(FMT, 40, 10, H, D, torch.bfloat16)
    for pool in pools:
        if pool.is_floating_point():
            pool.copy_(torch.randn(pool.shape, generator=g))
        else:
            pool.copy_(torch.randint(0, 256, pool.shape, generator=g))
    return pools


def _write(pools, k, v, start: int, end: int, window=WINDOW, quant=QUANT) -> None:
    """cache_write_ref of positions [start, end) of one sequence whose cache holds ``start``."""
    cache_write_ref(k[start:end], v[start:end], torch.tensor([0, end - start]), torch.tensor([start]),
                    torch.tensor([window]), torch.tensor([quant]), *pools, sink=S0, recent=W, bits=FMT.bits,
                    group_size=FMT.group_size, clip_k=CLIP, clip_v=CLIP)


def _batch(L: int, T: int, take: SnapshotTake) -> Batch:
    """Row 0: another sequence's one token; row 1: the chunk [L, L + T) that takes the snapshot."""
    return Batch(seq_ids=[1, 0], token_ids=[[0], [0] * T], positions=[[20], list(range(L, L + T))],
                 cache_lens=[20, L], history_lens=[LAYOUT.num_history_tokens(20), LAYOUT.num_history_tokens(L)],
                 window_tables=[OTHER_WINDOW, WINDOW], quant_tables=[OTHER_QUANT, QUANT],
                 context_token_ids=[(), ()], layout=LAYOUT, snapshot_takes=((1, take),))


CASES = [  # (L, T, R): the chunk [L, L + T) passes the boundary R
    (0, 40, 8),  # from an empty cache: the chunk starts in the sink, the ring is not full at R
    (2, 10, 8),
    (5, 20, 6),  # next to the chunk's start, inside a page
    (5, 20, 24),  # next to its end, at a page boundary
    (13, 7, 16),
    (17, 30, 44),  # the window at R lies wholly in the chunk
    (30, 25, 31),  # a ring that wrapped: next to the start
    (30, 25, 40),
    (30, 25, 45),
    (30, 25, 54),  # next to the end
    (33, 3, 34),
]


@pytest.mark.parametrize("L, T, R", CASES)
@pytest.mark.parametrize("ring_pages", [(0, 1), (1,)], ids=["whole", "one-page-missing"])
def test_a_snapshot_inside_a_chunk_equals_the_one_at_a_cut(L, T, R, ring_pages):
    g = torch.Generator().manual_seed(L * 100 + R)
    k, v = (torch.randn(L + T, H, D, generator=g) for _ in range(2))
    dst = [SNAPSHOT[j] for j in range(len(ring_pages))]

    cut = _pools(0)  # the reference: a chunk ends at R, then the ring pages are copied
    _write(cut, k, v, 0, L)
    _write(cut, k, v, L, R)
    want = [pool[[WINDOW[1 + r] for r in ring_pages]].clone() for pool in cut[:2]]

    inside = _pools(0)
    _write(inside, k, v, 0, L)
    untouched = [pool[SNAPSHOT].clone() for pool in inside[:2]]
    takes = StepSnapshotTakes(_batch(L, T, SnapshotTake(R, ring_pages, tuple(dst))), torch.device("cpu"))
    new_k, new_v = (torch.cat([torch.randn(1, H, D, generator=g), x[L:L + T]]) for x in (k, v))  # the step's rows
    takes.take(new_k, new_v, *inside[:2])
    _write(inside, k, v, L, L + T)  # the chunk's write, after the take

    for got_pool, want_pages, before in zip(inside[:2], want, untouched, strict=True):
        assert torch.equal(got_pool[dst], want_pages)
        assert torch.equal(got_pool[SNAPSHOT[len(dst):]], before[len(dst):])  # no other page written
        if len(ring_pages) == W // P:  # (the write replaces R - W by R: the ring then differs)
            assert not torch.equal(got_pool[WINDOW[1:]], want_pages)  # a copy after the write would not do


def test_a_take_must_lie_inside_its_row():
    with pytest.raises(ValueError, match="does not pass"):
        StepSnapshotTakes(_batch(8, 8, SnapshotTake(16, (0, 1), (5, 6))), torch.device("cpu"))
