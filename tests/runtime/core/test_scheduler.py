"""Continuous batching on the CPU: budgets, chunked prefill, FCFS, preemption, aborts."""

from __future__ import annotations

import random

import pytest
from runtime_fakes import IdentityCache, check_page_invariants, run_scheduler

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import FinishReason, Sequence, SequenceStatus

P = 16


def make_scheduler(num_window=60, num_quant=200, sink=16, recent=32, prefix=True, **kwargs):
    layout = CacheLayout.uniform(num_layers=1, num_kv_heads=1, head_dim=16, group_size=16, page_size=P,
                                 sink=sink, recent=recent)
    bm = PageManager(layout, num_window, num_quant, enable_prefix_caching=prefix, history_hits=True)
    return Scheduler(bm, **kwargs)


def seq(num_prompt: int, max_tokens: int = 4, first: int = 0) -> Sequence:
    return Sequence([(first + i) % 50 for i in range(num_prompt)], SamplingParams(max_tokens=max_tokens))


def step(scheduler: Scheduler):
    """Schedule and pretend the model ran: counters advance, finished prefills get a token."""
    out = scheduler.schedule()
    scheduler.advance(out)
    for s in out.seqs:
        if s.num_cached_tokens == s.num_tokens:
            s.append_token(1)
            if s.num_output_tokens >= s.params.max_tokens:
                scheduler.finish(s, FinishReason.LENGTH)
    return [(s.seq_id, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True)], out


def test_chunked_prefill_fills_the_budget_in_arrival_order():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    a, b, c = seq(100), seq(50, first=20), seq(10, first=30)
    for s in (a, b, c):
        scheduler.add(s)
    assert step(scheduler)[0] == [(a.seq_id, 64)]
    assert step(scheduler)[0] == [(a.seq_id, 36), (b.seq_id, 28)]
    assert step(scheduler)[0] == [(a.seq_id, 1), (b.seq_id, 22), (c.seq_id, 10)]
    assert step(scheduler)[0] == [(a.seq_id, 1), (b.seq_id, 1), (c.seq_id, 1)]  # one decode batch


def test_max_num_seqs_caps_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=512)
    seqs = [seq(5, max_tokens=3) for _ in range(5)]
    for s in seqs:
        scheduler.add(s)
    scheduled, _ = step(scheduler)
    assert [i for i, _ in scheduled] == [seqs[0].seq_id, seqs[1].seq_id]
    while scheduler.has_unfinished():
        step(scheduler)
        assert scheduler.num_running <= 2
    assert all(s.is_finished for s in seqs)


def test_the_queue_head_is_never_skipped():
    """A large request at the head waits for room; a small one behind it does not overtake it."""
    scheduler = make_scheduler(num_window=6, num_quant=8, max_num_batched_tokens=512)
    first = seq(120, max_tokens=5)  # history up to [16, 77): 5 quant pages
    big = seq(150, max_tokens=5, first=13)  # 7 quant pages: cannot join while first runs
    small = seq(5, max_tokens=5, first=29)  # would fit at once
    admitted: dict[int, int] = {}
    for s in (first, big, small):
        scheduler.add(s)
    num_steps = 0
    while scheduler.has_unfinished():
        step(scheduler)
        num_steps += 1
        for s in scheduler.running:
            admitted.setdefault(s.seq_id, num_steps)
    assert admitted[first.seq_id] == 1 and admitted[big.seq_id] > 1
    assert admitted[big.seq_id] <= admitted[small.seq_id]


def test_pages_running_out_preempt_the_newest():
    scheduler = make_scheduler(num_window=9, num_quant=6, max_num_batched_tokens=512)
    old, mid, new = seq(60, max_tokens=60), seq(60, max_tokens=60, first=7), seq(60, max_tokens=60, first=9)
    for s in (old, mid, new):
        scheduler.add(s)
    step(scheduler)  # each holds 1 history page (history [16, 28))
    preempted = []
    while not preempted:
        _, out = step(scheduler)
        preempted = out.preempted
    assert preempted[0] is new and new.status is SequenceStatus.WAITING
    assert not new.has_pages and new.num_cached_tokens == 0 and new.num_output_tokens > 0
    assert scheduler.waiting[0] is new and scheduler.num_preemptions >= 1


def prompts(rng: random.Random, count: int) -> list[tuple[list[int], int]]:
    stem = [rng.randrange(50) for _ in range(80)]
    return [(stem[: rng.randrange(1, 80)] + [rng.randrange(50) for _ in range(rng.randrange(0, 60))],
             rng.randrange(1, 50)) for _ in range(count)]


def run(requests, **kwargs) -> tuple[list[list[int]], dict, Scheduler]:
    scheduler = make_scheduler(**kwargs)
    seqs = [Sequence(list(p), SamplingParams(max_tokens=m)) for p, m in requests]
    for s in seqs:
        scheduler.add(s)
    stats = run_scheduler(scheduler, IdentityCache(scheduler.page_manager))
    check_page_invariants(scheduler.page_manager, [])
    assert all(s.is_finished and s.num_output_tokens == s.params.max_tokens for s in seqs)
    return [s.output_token_ids for s in seqs], stats, scheduler


@pytest.mark.parametrize("seed", range(4))
def test_preemption_chunking_and_prefix_hits_do_not_change_outputs(seed):
    requests = prompts(random.Random(seed), 30)
    reference, ref_stats, _ = run(requests, num_window=200, num_quant=1000, prefix=False,
                                  max_num_batched_tokens=4096, max_num_seqs=64)
    assert ref_stats["preempted"] == 0
    tight, stats, scheduler = run(requests, num_window=30, num_quant=14,
                                  max_num_batched_tokens=[13, 64, 256, 29][seed], max_num_seqs=8)
    assert tight == reference
    assert stats["preempted"] > 0 and scheduler.page_manager.num_prefix_hit_tokens > 0


def test_add_refuses_a_request_that_never_fits():
    scheduler = make_scheduler(num_window=3, num_quant=2)  # at most 16 + 32 + 32 = 80 tokens
    scheduler.add(seq(70, max_tokens=10))
    with pytest.raises(ValueError, match="KV pages"):
        scheduler.add(seq(70, max_tokens=11))
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add(Sequence([], SamplingParams()))
    capped = Scheduler(scheduler.page_manager, max_model_len=80)
    capped.add(seq(70, max_tokens=1000))  # max_model_len caps the length it can reach


def test_finish_frees_pages_from_waiting_and_running():
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=512)
    running, waiting = seq(100), seq(100)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    assert running.status is SequenceStatus.RUNNING and running.has_pages
    scheduler.finish(waiting, FinishReason.ABORT)
    scheduler.finish(running, FinishReason.ABORT)
    assert not scheduler.has_unfinished()
    assert running.finish_reason is FinishReason.ABORT and not running.has_pages
    bm = scheduler.page_manager
    assert bm.window_pool.num_used == 0 and bm.quant_pool.num_used == 0
    assert step(scheduler)[0] == []


@pytest.mark.parametrize("kwargs, field", [(dict(max_num_seqs=0), "max_num_seqs"),
                                            (dict(max_num_batched_tokens=0), "max_num_batched_tokens")])
def test_scheduler_settings_are_validated(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_scheduler(**kwargs)
