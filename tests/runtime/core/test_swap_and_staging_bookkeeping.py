"""Swapping and staging bookkeeping on the CPU: the host allocator, staged admission, and page
contents that survive swaps (the identity cache of runtime_fakes follows every copy)."""

from __future__ import annotations

import random

from runtime_fakes import IdentityCache, run_scheduler

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import Sequence, SequenceStatus
from oscar_compile.runtime.core.swap_space import ALIGN, SwapSpace

P = 16
LAYOUT = CacheLayout.uniform(num_layers=1, num_kv_heads=1, head_dim=16, group_size=16, page_size=P, sink=16, recent=32)


def make(num_window=60, num_quant=200, staging=0, swap_bytes=0, **kwargs) -> Scheduler:
    swap = SwapSpace(swap_bytes, LAYOUT.window_page_bytes, LAYOUT.quant_page_bytes) if swap_bytes else None
    bm = PageManager(LAYOUT, num_window, num_quant, history_hits=True, num_staging_pages=staging, swap_space=swap)
    return Scheduler(bm, **kwargs)


def seq(num_prompt: int, max_tokens: int = 4, first: int = 0) -> Sequence:
    return Sequence([(first + i) % 50 for i in range(num_prompt)], SamplingParams(max_tokens=max_tokens))


def test_swap_space_first_fit_and_merging():
    space = SwapSpace(10 * ALIGN, ALIGN, ALIGN // 2)
    a = space.allocate(2, 0)  # 2 * 512
    b = space.allocate(1, 1)  # 768 -> 1024
    c = space.allocate(3, 0)
    assert (a, b, c) == (0, 2 * ALIGN, 4 * ALIGN) and space.num_used_bytes == 7 * ALIGN
    assert not space.can_fit(4, 0) and space.can_fit(3, 0)
    space.free(b)
    assert space.allocate(1, 0) == 2 * ALIGN  # first fit: the hole
    space.free(a)
    space.free(2 * ALIGN)
    space.free(c)  # merged back into one range
    assert space.is_empty() and space.num_ranges == 0
    assert not space.can_fit(0, 0)  # nothing to swap: not a swap


def test_a_staged_prompt_reserves_its_whole_history_and_the_next_one_waits():
    """16 staging pages. A 202-token prompt (history 154 tokens: 10 pages) is staged in 64-token
    chunks; a 220-token one (11 pages) waits at the head of the queue until the first one's last
    chunk has run and its staging pages are free again."""
    scheduler = make(staging=16, max_num_batched_tokens=64)
    bm = scheduler.page_manager
    a, b = seq(202, first=1), seq(220, first=7)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert out.seqs == [a] and len(a.staging_pages) == 10 and bm.staging_pool.num_available == 6
    scheduler.advance(out)
    while a.num_cached_tokens < a.num_tokens:
        out = scheduler.schedule()
        assert b.status is SequenceStatus.WAITING and not b.staging_pages
        scheduler.advance(out)
    assert not a.is_staged and bm.staging_pool.num_available == 16  # freed by the last chunk's advance
    a.append_token(1)
    out = scheduler.schedule()
    assert out.seqs == [a, b] and len(b.staging_pages) == 11
    assert bm.num_staged_prefills == 2 and bm.peak_staging_pages == 11


def test_a_prompt_in_one_chunk_or_without_history_is_not_staged():
    scheduler = make(staging=16, max_num_batched_tokens=64)
    short = seq(60)  # history 12 tokens, one chunk: generate()'s bulk write already
    scheduler.add(short)
    assert scheduler.schedule().seqs == [short] and not short.is_staged
    scheduler = make(staging=16, max_num_batched_tokens=16)
    tiny = seq(40, first=5)  # three chunks, but it fits sink + recent: never any history
    scheduler.add(tiny)
    assert scheduler.schedule().seqs == [tiny] and not tiny.is_staged


def test_random_workload_with_swapping_keeps_every_page_content():
    """A tight page budget, swap space for about two sequences: preemptions swap out and back
    in, the identity cache reads every position back after each step, nothing leaks."""
    rng = random.Random(0)
    swap_bytes = 2 * (3 * LAYOUT.window_page_bytes + 8 * LAYOUT.quant_page_bytes)
    scheduler = make(num_window=15, num_quant=24, staging=40, swap_bytes=swap_bytes, max_num_batched_tokens=48)
    for i in range(14):
        scheduler.add(seq(rng.randint(5, 150), max_tokens=rng.randint(1, 60), first=i))
    cache = IdentityCache(scheduler.page_manager)
    stats = run_scheduler(scheduler, cache)
    bm = scheduler.page_manager
    assert stats["preempted"] > 0 and scheduler.num_swap_preemptions > 0
    assert bm.swap_space.num_swapped_in == scheduler.num_swap_preemptions
    assert bm.swap_space.is_empty() and not cache.host
    for pool in (bm.window_pool, bm.quant_pool, bm.staging_pool):
        assert pool.num_used == 0
