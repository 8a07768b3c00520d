"""Window snapshots (runtime/core/window_snapshots.py): where they are taken, what a hit at one
restores, and their pages, which the window pool evicts like cached blocks.

The identity cache (runtime_fakes.py) follows the page copies the scheduler hands out; run in
``standard_only`` mode (a writer that derives the ring from the cache length alone), it also checks
that a hit at a snapshot leaves the standard state: no history floor.
"""

from __future__ import annotations

import random

import pytest
from runtime_fakes import IdentityCache, check_page_invariants, run_scheduler

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import FinishReason, Sequence
from oscar_compile.runtime.core.swap_space import SwapSpace
from oscar_compile.runtime.core.window_snapshots import (
    WindowSnapshots,
    default_interval,
    history_tokens_per_snapshot,
)

P = 16
S0, W = 16, 32  # one sink page, a ring of two pages: a snapshot is two window pages
INTERVAL = 64


def make_bm(num_window=40, num_quant=80, sink=S0, recent=W, interval=INTERVAL) -> PageManager:
    layout = CacheLayout.uniform(
        num_layers=2, num_kv_heads=2, head_dim=16, page_size=P, group_size=16, sink=sink, recent=recent
    )
    bm = PageManager(layout, num_window, num_quant)
    bm.snapshots = WindowSnapshots(layout, bm.window_pool, interval)
    return bm


def step(scheduler: Scheduler, cache: IdentityCache) -> list[int]:
    """One scheduler step through the identity cache; the chunk lengths."""
    out = scheduler.schedule()
    for copy in out.page_copies:
        cache.copy_pages(copy)
    cache.take_snapshots(out)
    for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
        cache.write(seq, num_new)
    for copy in scheduler.advance(out):
        cache.copy_pages(copy)
    return out.num_new_tokens


def prefill(scheduler: Scheduler, cache: IdentityCache, seq: Sequence) -> list[int]:
    """Queue ``seq`` and run it alone until its prompt is cached; its chunk lengths."""
    scheduler.add(seq)
    chunks = []
    while seq.num_cached_tokens < seq.num_tokens:
        chunks += step(scheduler, cache)
        cache.check(seq)
    return chunks


def test_chunks_follow_the_budget_and_pass_boundaries_with_snapshots_inside():
    """2000 tokens, a budget of 512, snapshots every 256: chunks of 512 (not cut at 256s); the
    boundaries inside a chunk are taken in its step, those at a chunk's end after it."""
    bm = make_bm(num_window=64, num_quant=200, interval=256)
    scheduler = Scheduler(bm, max_num_batched_tokens=512)
    cache = IdentityCache(bm, standard_only=True)
    seq = Sequence(list(range(2000)), SamplingParams(max_tokens=1))
    scheduler.add(seq)
    chunks, inside = [], []
    while seq.num_cached_tokens < seq.num_tokens:
        out = scheduler.schedule()
        inside += [take.boundary for _, take in out.snapshot_takes]
        cache.take_snapshots(out)
        for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
            cache.write(s, n)
        for copy in scheduler.advance(out):
            cache.copy_pages(copy)
        chunks += out.num_new_tokens
    assert chunks == [512, 512, 512, 464]
    assert inside == [256, 768, 1280, 1792, 1984]  # 1984 = 1999 // 16 * 16, the prompt's last page
    assert bm.snapshots.num_captured == 8  # and 512, 1024, 1536 after their steps
    scheduler.finish(seq, FinishReason.LENGTH)
    for R in (256, 512, 1792, 1984):  # a prompt sharing [0, R + 1) resumes at R, the ring restored
        other = Sequence(list(range(R + 1)) + [7] * 5, SamplingParams(max_tokens=1))
        assert prefill(scheduler, cache, other) == [6]  # cache.check: every position its own identity
        assert other.num_prefix_cached_tokens == R
        scheduler.finish(other, FinishReason.LENGTH)
    check_page_invariants(bm, [])


def test_a_snapshot_inside_a_chunk_holds_what_one_at_a_cut_holds():
    """The identity of every slot of every snapshot page, taken inside chunks (budget 100) and at
    cuts (budget 16: every boundary ends a chunk), stale slots of a ring not yet full included."""
    contents = []
    for budget in (100, 16):
        bm = make_bm(interval=32)
        scheduler = Scheduler(bm, max_num_batched_tokens=budget)
        cache = IdentityCache(bm)
        prefill(scheduler, cache, Sequence(list(range(150)), SamplingParams(max_tokens=1)))
        hashes = Sequence(list(range(150)), SamplingParams(max_tokens=1))
        bm._update_hashes(hashes)
        pages = {R: bm.snapshots.lookup(hashes.block_hashes[R // P - 1]) for R in (32, 64, 96, 128, 144)}
        assert all(p is not None for p in pages.values())
        contents.append({R: [cache.window.get((p, r)) for p in ps for r in range(P)] for R, ps in pages.items()})
    assert contents[0] == contents[1]


@pytest.mark.parametrize("num_tokens", [150, 144, 145, 40, 33])  # 33: a ring not yet full
def test_a_resend_resumes_at_its_prompts_last_page_with_the_ring_restored(num_tokens):
    bm = make_bm()
    scheduler = Scheduler(bm, max_num_batched_tokens=1000)
    cache = IdentityCache(bm, standard_only=True)
    first = Sequence(list(range(num_tokens)), SamplingParams(max_tokens=1))
    prefill(scheduler, cache, first)
    scheduler.finish(first, FinishReason.LENGTH)
    again = Sequence(list(range(num_tokens)), SamplingParams(max_tokens=1))
    chunks = prefill(scheduler, cache, again)  # cache.check: every position reads its own identity
    R = (num_tokens - 1) // P * P
    assert again.num_prefix_cached_tokens == R and again.history_floor == 0
    assert chunks == [num_tokens - R] and bm.snapshots.num_hits == 1
    assert len(again.quant_pages) == bm.layout.num_quant_pages_for(bm.history_len(again))
    check_page_invariants(bm, [again])


def test_a_shared_prefix_resumes_at_the_last_snapshot_it_covers():
    bm = make_bm()
    scheduler = Scheduler(bm, max_num_batched_tokens=1000)
    cache = IdentityCache(bm, standard_only=True)
    stem = list(range(150))
    first = Sequence(stem + [1] * 20, SamplingParams(max_tokens=1))  # snapshots at 64, 128 and 160
    prefill(scheduler, cache, first)
    second = Sequence(stem + [2] * 30, SamplingParams(max_tokens=1))
    prefill(scheduler, cache, second)  # shares [0, 150): resumes at 128, beside the running first
    assert second.num_prefix_cached_tokens == 128
    shared = (128 - W - S0) // P
    assert second.quant_pages[:shared] == first.quant_pages[:shared]
    assert bm.quant_pool.num_shared == shared and bm.window_pool.num_shared == 1  # the sink page
    check_page_invariants(bm, [first, second])


def test_no_snapshot_no_hit_past_the_sink():
    bm = make_bm(interval=1024)
    scheduler = Scheduler(bm, max_num_batched_tokens=1000)
    cache = IdentityCache(bm, standard_only=True)
    prefill(scheduler, cache, Sequence(list(range(100)), SamplingParams(max_tokens=1)))  # snapshot at 96
    other = Sequence(list(range(90)) + [5] * 30, SamplingParams(max_tokens=1))
    prefill(scheduler, cache, other)
    assert other.num_prefix_cached_tokens == S0


def test_snapshots_are_evicted_before_an_admission_waits():
    """A pool of two sequences' windows: the snapshots of a finished sequence fill what it left,
    and two new sequences still get in at once."""
    bm = make_bm(num_window=6)
    scheduler = Scheduler(bm, max_num_batched_tokens=1000)
    cache = IdentityCache(bm)
    first = Sequence(list(range(150)), SamplingParams(max_tokens=1))
    prefill(scheduler, cache, first)
    scheduler.finish(first, FinishReason.LENGTH)
    assert bm.window_pool.num_cached >= 2 * bm.snapshots.num_pages  # whole snapshots kept
    for seq in (Sequence([3] * 100, SamplingParams(max_tokens=1)), Sequence([4] * 100, SamplingParams(max_tokens=1))):
        scheduler.add(seq)
    assert step(scheduler, cache) == [100, 100]  # both admitted (a snapshot cuts no chunk)
    assert bm.window_pool.num_used == 6 and bm.window_pool.num_evictions >= 4
    assert bm.snapshots.num_captured == 3  # the first's: no room left for theirs, and none waited


@pytest.mark.parametrize("layout", [dict(sink=16, recent=32), dict(sink=0, recent=16), dict(sink=16, recent=16)])
@pytest.mark.parametrize("num_quant", [12, 400])
@pytest.mark.parametrize("swap", [False, True])
def test_random_workload_hits_snapshots_and_leaks_no_page(layout, num_quant, swap):
    """Shared stems, preemption (recomputed, or swapped) under a small history pool: every
    position reads back its own identity at every step, in the standard state; once all
    finished, every page is cached or free, and free after the cache is reset."""
    rng = random.Random(hash((tuple(layout.values()), num_quant, swap)) & 0xFFFF)
    bm = make_bm(num_window=6 * (layout["sink"] + layout["recent"]) // P, num_quant=num_quant, interval=32, **layout)
    if swap:
        bm.swap_space = SwapSpace(
            20 * bm.layout.quant_page_bytes, bm.layout.window_page_bytes, bm.layout.quant_page_bytes
        )
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=rng.choice([7, 40, 128]))
    stems = [[rng.randrange(50) for _ in range(rng.randrange(40, 140))] for _ in range(3)]
    for _ in range(25):
        prompt = rng.choice(stems)[: rng.randrange(1, 140)] + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        max_tokens = rng.randrange(1, 40)
        if bm.can_ever_fit(len(prompt) + max_tokens):
            scheduler.add(Sequence(prompt, SamplingParams(max_tokens=max_tokens)))
    run_scheduler(scheduler, IdentityCache(bm, standard_only=True))
    assert bm.snapshots.num_hits > 0 and bm.snapshots.num_captured > 0
    for pool in (bm.window_pool, bm.quant_pool):
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_pages
        pool.reset_prefix_cache()
        assert pool.num_free == pool.num_pages


def test_the_memory_a_snapshot_costs():
    """At 8B (36 layers, 8 KV heads, D = 128, BF16, INT2 history with G = 128 and fp16 scale and
    zero) with W = 256: 37.7 MB a snapshot, the history of 1820 tokens; snapshots every 3648."""
    layout = CacheLayout.uniform(num_layers=36, num_kv_heads=8, head_dim=128, page_size=16, sink=64, recent=256)
    snapshot = WindowSnapshots(layout, make_bm().window_pool, 16)
    assert snapshot.snapshot_bytes == 36 * 2 * 8 * 128 * 2 * 256 == 37_748_736
    assert layout.quant_page_bytes // 16 == 36 * 2 * 8 * (32 + 4) == 20_736
    assert history_tokens_per_snapshot(layout) == pytest.approx(1820.4, abs=0.1)
    assert default_interval(layout) == 3648
