"""Page bookkeeping: allocation, demotion counts, prefix sharing, reference counts, eviction."""

from __future__ import annotations

import math
import random

import pytest
from runtime_fakes import IdentityCache, check_page_invariants, run_scheduler

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import Sequence

P = 16
WINDOWED = dict(sink=16, recent=32)  # S0 = 1 page, W = 2 pages
LAYOUTS = [dict(sink=16, recent=32), dict(sink=0, recent=0), dict(sink=32, recent=0),
           dict(sink=0, recent=16), dict(sink=16, recent=16)]


def make_layout(**kwargs) -> CacheLayout:
    return CacheLayout.uniform(num_layers=2, num_kv_heads=2, head_dim=16, page_size=P, group_size=16, **kwargs)


def make_bm(num_window=40, num_quant=80, **kwargs) -> PageManager:
    flags = {"history_hits": True}
    flags.update({k: kwargs.pop(k) for k in ("history_hits", "enable_prefix_caching") if k in kwargs})
    return PageManager(make_layout(**{**WINDOWED, **kwargs}), num_window, num_quant, **flags)


def admit(bm: PageManager, cache: IdentityCache, seq: Sequence) -> int:
    """Admit and prefill the whole sequence in one chunk; returns the prefix-hit length."""
    match = bm.match_prefix(seq)
    num_new = seq.num_tokens - match.num_tokens
    assert bm.can_allocate(seq, match, num_new)
    bm.allocate(seq, match)
    bm.may_append(seq, num_new)
    cache.write(seq, num_new)
    seq.num_cached_tokens += num_new
    bm.commit(seq)
    return match.num_tokens


def grow(bm: PageManager, cache: IdentityCache, seq: Sequence, num_new: int) -> None:
    seq.token_ids += [(seq.num_tokens * 7919) % 97 for _ in range(num_new)]
    assert bm.can_append(seq, num_new)
    bm.may_append(seq, num_new)
    cache.write(seq, num_new)
    seq.num_cached_tokens += num_new
    bm.commit(seq)


def test_allocate_takes_the_windows_and_deallocate_returns_every_page():
    bm = make_bm()
    seq = Sequence(list(range(10)))
    admit(bm, IdentityCache(bm), seq)
    assert len(seq.window_pages) == 3 and seq.quant_pages == []
    assert bm.window_pool.num_used == 3
    bm.deallocate(seq)
    assert seq.window_pages == [] and seq.num_cached_tokens == 0
    assert bm.window_pool.num_used == 0 and bm.quant_pool.num_used == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", [1, 5, 16, 37])
def test_a_quant_page_per_page_size_demoted_tokens(layout, chunk):
    bm = make_bm(**layout)
    cache = IdentityCache(bm)
    seq = Sequence([1, 2, 3])
    admit(bm, cache, seq)
    S0, W = layout["sink"], layout["recent"]
    while seq.num_cached_tokens < 300:
        grow(bm, cache, seq, chunk)
        history = max(0, seq.num_cached_tokens - W - S0)
        assert bm.history_len(seq) == history
        assert len(seq.quant_pages) == math.ceil(history / P)
        assert len(seq.window_pages) == (S0 + W) // P
        cache.check(seq)


def test_a_hit_shares_sink_and_history_pages_with_reference_counts():
    bm = make_bm()
    cache = IdentityCache(bm)
    a = Sequence(list(range(100)))
    admit(bm, cache, a)  # history [16, 68): 3 full pages; final blocks: 1 sink + 3 history
    assert a.num_committed_blocks == 4
    b = Sequence(list(range(100)) + [5] * 20)
    assert admit(bm, cache, b) == 64
    assert b.window_pages[0] == a.window_pages[0] and b.quant_pages[:3] == a.quant_pages[:3]
    assert bm.window_pool.ref_counts[a.window_pages[0]] == 2
    assert all(bm.quant_pool.ref_counts[p] == 2 for p in a.quant_pages[:3])
    assert set(b.window_pages[1:]).isdisjoint(a.window_pages)  # the ring is never shared
    cache.check(a)
    cache.check(b)
    check_page_invariants(bm, [a, b])
    assert bm.num_prefix_hit_tokens == 64 and bm.num_prefix_queried_tokens == 220


@pytest.mark.parametrize("num_tokens", [17, 48, 49, 64, 80, 81, 95, 96, 97, 130])
def test_the_hit_leaves_the_recent_window_to_recompute(num_tokens):
    """R <= n - W, whole pages only, never past what is cached (64 tokens here)."""
    bm = make_bm()
    cache = IdentityCache(bm)
    admit(bm, cache, Sequence(list(range(100))))
    seq = Sequence((list(range(100)) + [9] * 40)[:num_tokens])
    match = bm.match_prefix(seq)
    expected = min(64, max(num_tokens - 32, 0) // P * P)
    assert match.num_tokens == expected
    admit(bm, cache, seq)
    cache.check(seq)
    # once the prompt is in, the state is the standard one
    assert bm.history_len(seq) == max(0, num_tokens - 32 - 16)


def test_history_is_held_at_the_hit_until_the_ring_refills():
    bm = make_bm()
    cache = IdentityCache(bm)
    admit(bm, cache, Sequence(list(range(100))))
    b = Sequence(list(range(100)) + [4] * 20)
    match = bm.match_prefix(b)
    bm.allocate(b, match)
    assert b.num_cached_tokens == 64 and bm.history_len(b) == 48  # ring empty: [16, 64) history
    for num_cached in range(64, 64 + 33):
        assert bm.history_len(b, num_cached) == max(48, num_cached - 48)


def test_without_history_hits_the_hit_stops_at_the_sink():
    bm = make_bm(history_hits=False)
    cache = IdentityCache(bm, standard_only=True)
    a = Sequence(list(range(100)))
    admit(bm, cache, a)
    b = Sequence(list(range(100)) + [3] * 20)
    assert admit(bm, cache, b) == 16
    cache.check(a)
    cache.check(b)


def test_a_writer_ignoring_history_lens_would_corrupt_shared_pages():
    """Why history hits are opt-in: after one, the standard rule demotes an empty ring."""
    bm = make_bm(history_hits=True)
    cache = IdentityCache(bm, standard_only=True)
    a = Sequence(list(range(100)))
    admit(bm, cache, a)
    admit(bm, cache, Sequence(list(range(100)) + [3] * 40))
    with pytest.raises(AssertionError, match="wrong content"):
        cache.check(a)


def test_bf16_mode_hits_everything_but_the_last_token():
    bm = make_bm(sink=0, recent=0)
    cache = IdentityCache(bm)
    admit(bm, cache, Sequence(list(range(64))))
    assert admit(bm, cache, Sequence(list(range(64)))) == 48  # 63 // 16 pages
    assert admit(bm, cache, Sequence(list(range(65)))) == 64


def test_released_pages_stay_cached_and_are_evicted_tail_first():
    bm = make_bm(num_window=6, num_quant=4)
    cache = IdentityCache(bm)
    a = Sequence(list(range(100)))  # history 52 tokens: 4 quant pages, 3 of them final
    admit(bm, cache, a)
    bm.deallocate(a)
    assert bm.quant_pool.num_cached == 3 and bm.quant_pool.num_free == 1
    assert bm.window_pool.num_cached == 1  # the sink page; ring pages hold nothing reusable
    b = Sequence([7] * 100)  # unrelated, needs 4 quant pages: takes the free one, evicts 3
    admit(bm, cache, b)
    assert bm.quant_pool.num_evictions == 3
    assert bm.match_prefix(Sequence(list(range(100)) + [1] * 40)).num_tokens == 16  # sink only
    bm.deallocate(b)
    c = Sequence([8] * 80)  # 2 quant pages: b's non-final one (free), then the LRU cached one
    admit(bm, cache, c)
    assert bm.quant_pool.num_evictions == 4
    assert bm.match_prefix(Sequence([7] * 100 + [2] * 30)).num_tokens == 16 + 2 * P


def test_matched_pages_are_not_evicted_by_the_admission_that_reuses_them():
    bm = make_bm(num_window=3, num_quant=4)
    cache = IdentityCache(bm)
    a = Sequence(list(range(100)))  # 4 quant pages (history [16, 68)), 3 of them final
    admit(bm, cache, a)
    a_pages = list(a.quant_pages)
    bm.deallocate(a)  # quant: 3 cached + 1 free; window: sink cached + 2 free
    b = Sequence(list(range(100)) + [6] * 20)
    match = bm.match_prefix(b)
    assert match.num_tokens == 64 and list(match.quant_pages) == a_pages[:3]
    # the whole prompt needs 5 history pages: 3 matched + 2 fresh, but only 1 is not matched
    assert not bm.can_allocate(b, match, b.num_tokens - 64)
    assert bm.can_allocate(b, match, 20)  # 84 cached: history still [16, 64)
    bm.allocate(b, match)
    bm.may_append(b, 20)
    assert b.quant_pages == a_pages[:3] and bm.quant_pool.num_evictions == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("history_hits", [True, False])
@pytest.mark.parametrize("num_quant", [12, 400])
def test_random_workload_with_shared_prefixes_stays_consistent(layout, history_hits, num_quant):
    rng = random.Random(hash((tuple(layout.values()), history_hits, num_quant)) & 0xFFFF)
    bm = PageManager(make_layout(**layout), 12 * max(1, (layout["sink"] + layout["recent"]) // P),
                      num_quant, history_hits=history_hits)
    scheduler = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=rng.choice([7, 40, 128]))
    stems = [[rng.randrange(50) for _ in range(rng.randrange(10, 120))] for _ in range(3)]
    for _ in range(25):
        prompt = rng.choice(stems)[: rng.randrange(1, 120)] + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        max_tokens = rng.randrange(1, 40)
        if bm.can_ever_fit(len(prompt) + max_tokens):
            scheduler.add(Sequence(prompt, SamplingParams(max_tokens=max_tokens)))
    stats = run_scheduler(scheduler, IdentityCache(bm, standard_only=not history_hits))
    assert stats["steps"] > 0
    for pool in (bm.window_pool, bm.quant_pool):
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_pages
        pool.reset_prefix_cache()
        assert pool.num_free == pool.num_pages


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("prompt_len", [3, 16, 20, 50, 70])
@pytest.mark.parametrize("hit", [False, True])
def test_forked_choices_read_the_prompt_and_then_their_own_tokens(layout, prompt_len, hit):
    """Parallel sampling: choices forked from a cached prompt (after a prefix hit or not) read it
    back whole, share its final sink and full history pages (one reference more each) and copy
    the rest into the pages reserved at admission; each then grows on its own pages."""
    bm = make_bm(**layout)
    cache = IdentityCache(bm)
    prompt = [(7 * i) % 89 + 3 for i in range(prompt_len)]
    if hit:  # the prompt's blocks in the prefix cache, its sequence gone
        first = Sequence(list(prompt))
        admit(bm, cache, first)
        bm.deallocate(first)
    parent = Sequence(list(prompt), SamplingParams(n=3))
    num_window, num_quant = bm.window_pool.num_used, bm.quant_pool.num_used
    admit(bm, cache, parent)
    reserved = (len(parent.fork_window_pages), len(parent.fork_quant_pages))
    assert reserved == bm.fork_need(parent)
    children = [parent.fork(i) for i in (1, 2)]
    cache.copy_pages(bm.fork(parent, children))
    choices = [parent, *children]
    assert not parent.num_forks and parent.fork_window_pages == parent.fork_quant_pages == []
    assert [c.seq_id for c in choices] == sorted(c.seq_id for c in choices)
    # every page taken is a page of a choice: the reservation was exact
    holders = {p for c in choices for p in c.window_pages}, {p for c in choices for p in c.quant_pages}
    assert (len(holders[0]), len(holders[1])) == (bm.window_pool.num_used - num_window,
                                                  bm.quant_pool.num_used - num_quant)
    S0, W = layout["sink"], layout["recent"]
    shared_quant = max(prompt_len - S0 - W, 0) // P
    assert bm.quant_pool.num_shared == shared_quant and bm.window_pool.num_shared == min(prompt_len, S0) // P
    rng = random.Random(prompt_len)
    for _ in range(12):
        for c in choices:
            check_page_invariants(bm, choices)
            cache.check(c)
            num_new = rng.randrange(1, 6)
            c.token_ids += [rng.randrange(3, 97) for _ in range(num_new)]  # each its own tokens
            assert bm.can_append(c, num_new)
            bm.may_append(c, num_new)
            cache.write(c, num_new)
            c.num_cached_tokens += num_new
            bm.commit(c)
    for c in choices:
        cache.check(c)
        bm.deallocate(c)
    check_page_invariants(bm, [])
    assert bm.window_pool.num_used == bm.quant_pool.num_used == bm.quant_pool.num_shared == 0
