"""Deterministic mode's chunk rules (PageManager.make_deterministic): a position is computed by a
one-token call in every run or in none, since one-token calls run the decode kernels.

Random workloads on the identity cache (runtime_fakes): shared stems, window snapshots, prefix
hits, budgets that cut prompts, and a history pool small enough to preempt by recompute. In
deterministic mode no prompt chunk of a prompt of 2 or more tokens has one token or leaves one,
and a recomputed sequence's generated tokens come one per step; the same workloads in the default
mode break the first rule (so the check can fail), and every request finishes in both.
"""

from __future__ import annotations

import random

import pytest
from runtime_fakes import IdentityCache, run_scheduler

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import Sequence
from oscar_compile.runtime.core.window_snapshots import WindowSnapshots

P, S0, W = 16, 16, 32


def _run(seed: int, deterministic: bool, snapshots: bool) -> list[tuple[int, int, int, int]]:
    """(prompt tokens, cached tokens, new tokens, known tokens) of every chunk of a random workload."""
    rng = random.Random(seed)
    layout = CacheLayout.uniform(num_layers=1, num_kv_heads=1, head_dim=16, group_size=16, page_size=P, sink=S0,
                                 recent=W)  # fmt: skip
    bm = PageManager(layout, 6 * (S0 + W) // P, 14, history_hits=not snapshots)
    if snapshots:
        bm.snapshots = WindowSnapshots(layout, bm.window_pool, 32)
    if deterministic:
        bm.make_deterministic()
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=rng.choice([3, 7, 40, 65]))
    stems = [[rng.randrange(50) for _ in range(rng.randrange(40, 140))] for _ in range(3)]
    for _ in range(25):
        prompt = rng.choice(stems)[: rng.randrange(1, 140)] + [rng.randrange(50) for _ in range(rng.randrange(0, 40))]
        if rng.random() < 0.2:
            prompt = prompt[: rng.choice([1, 2, 17, 33, 49])]  # one token, or one past a page boundary
        max_tokens = rng.randrange(1, 40)
        if bm.can_ever_fit(len(prompt) + max_tokens):
            scheduler.add(Sequence(prompt, SamplingParams(max_tokens=max_tokens)))
    chunks = []
    schedule = scheduler.schedule

    def recorded():
        out = schedule()
        chunks.extend((s.num_prompt_tokens, s.num_cached_tokens, n, s.num_tokens)
                      for s, n in zip(out.seqs, out.num_new_tokens, strict=True))
        return out

    scheduler.schedule = recorded
    run_scheduler(scheduler, IdentityCache(bm, standard_only=snapshots))  # every request finishes
    return chunks


def _one_token_prompt_chunks(chunks) -> int:
    """Chunks of a prompt of >= 2 tokens that hold one token or leave one."""
    return sum(1 for prompt, cached, n, _ in chunks
               if cached < prompt and prompt >= 2 and (n == 1 or prompt - (cached + n) == 1))  # fmt: skip


@pytest.mark.parametrize("snapshots", [True, False], ids=["snapshots", "history-hits"])
def test_prompt_chunks_have_two_tokens_or_more_and_generated_ones_come_one_by_one(snapshots):
    default_breaks = replayed = 0
    for seed in range(12):
        chunks = _run(seed, deterministic=True, snapshots=snapshots)
        assert _one_token_prompt_chunks(chunks) == 0, seed
        assert all(n == 1 for prompt, cached, n, _ in chunks if cached >= prompt), seed
        assert all(cached + n <= prompt for prompt, cached, n, _ in chunks if cached < prompt), seed
        replayed += sum(1 for prompt, cached, n, known in chunks if prompt <= cached and cached + n < known)
        default_breaks += _one_token_prompt_chunks(_run(seed, deterministic=False, snapshots=snapshots))
    assert replayed > 0 and default_breaks > 0
