"""The engine's counters and the stats snapshot built from them (vLLM v1 keeps stats as
dataclasses too): ``EngineCounters`` is what the engine thread adds up as it runs,
``EngineStats`` a frozen snapshot of it and of the scheduler and pages, which the server reads
from another thread (``AsyncEngine.stats``) and ``/metrics`` renders.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import cached_property

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_pool import PagePool
from oscar_compile.runtime.core.scheduler import Scheduler

_THROUGHPUT_WINDOW_S = 10.0
PAGE_KINDS = ("window", "quant", "staging")
FORK_KINDS = ("window", "quant")


@dataclass
class EngineCounters:
    """Totals since the engine started; the engine thread alone writes them."""

    num_prompt_tokens: int = 0
    num_batched_tokens: int = 0  # every token run, prefill and recomputation included
    num_generation_tokens: int = 0
    num_requests_finished: int = 0
    num_requests_aborted: int = 0
    _recent_tokens: deque[tuple[float, int]] = field(default_factory=deque)

    def count_generated(self, num_tokens: int) -> None:
        now = time.monotonic()
        self.num_generation_tokens += num_tokens
        self._recent_tokens.append((now, num_tokens))
        while self._recent_tokens and now - self._recent_tokens[0][0] > _THROUGHPUT_WINDOW_S:
            self._recent_tokens.popleft()

    def generation_tokens_per_s(self) -> float:
        """Generated tokens per second over the last few seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent_tokens if now - t <= _THROUGHPUT_WINDOW_S]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / max(now - recent[0][0], 1e-3)


@dataclass(frozen=True)
class PoolStats:
    """One page pool (core/page_pool.py)."""

    pages_total: int
    pages_used: int
    pages_cached: int
    pages_free: int
    pages_shared: int  # held by more than one sequence (prefix hits, forked choices)

    @classmethod
    def of(cls, pool: PagePool) -> PoolStats:
        return cls(pool.num_pages, pool.num_used, pool.num_cached, pool.num_free, pool.num_shared)


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int  # a request whose grammar is compiling waits too (outside the scheduler)
    num_running: int
    num_preemptions: int
    num_swap_preemptions: int
    num_recompute_preemptions: int
    num_requests_finished: int
    num_requests_aborted: int
    prompt_tokens_total: int
    batched_tokens_total: int
    generation_tokens_total: int
    generation_tokens_per_s: float
    prefix_cache_hit_rate: float
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_staged_prefills: int
    staging_pages_peak: int
    swap_space_bytes: int
    swap_space_used_bytes: int
    num_swapped: int
    num_swap_ins: int
    window_snapshots_taken: int  # window snapshots (decode-consistent prefix hits): taken, hits restored
    window_snapshot_hits: int
    # tensor parallelism: every rank holds the same page ids (its own KV heads in each), so the
    # page counts are each rank's; the bytes are one rank's pools
    tensor_parallel_size: int
    kv_bytes_per_rank: int
    pools: dict[str, PoolStats]  # by kind: PAGE_KINDS
    fork_pages_shared: dict[str, int]  # parallel sampling: the pages choices took at their fork, by kind
    fork_pages_copied: dict[str, int]

    @cached_property
    def flat(self) -> dict[str, float]:
        """Every value under one name (``window_pages_used``, ``fork_quant_pages_copied``):
        the names ``/metrics`` (server/metrics.py) reads (made once per snapshot)."""
        values = {k: v for k, v in asdict(self).items() if not isinstance(v, dict)}
        for kind, pool in self.pools.items():
            values.update({f"{kind}_{name}": value for name, value in asdict(pool).items()})
        for how, counts in (("shared", self.fork_pages_shared), ("copied", self.fork_pages_copied)):
            values.update({f"fork_{kind}_pages_{how}": n for kind, n in counts.items()})
        return values

    def __getitem__(self, name: str) -> float:
        return self.flat[name]

    def get(self, name: str, default: float | None = None) -> float | None:
        return self.flat.get(name, default)


def engine_stats(counters: EngineCounters, scheduler: Scheduler, pages: PageManager, num_compiling: int,
                 tensor_parallel_size: int) -> EngineStats:
    """A snapshot; ``num_compiling``: requests whose grammar is still compiling."""
    layout, swap, snapshots = pages.layout, pages.swap_space, pages.snapshots
    pools = {pool.kind: pool for pool in (pages.window_pool, pages.quant_pool, pages.staging_pool)}
    page_bytes = {"window": layout.window_page_bytes, "quant": layout.quant_page_bytes,
                  "staging": layout.window_page_bytes}
    return EngineStats(
        num_waiting=scheduler.num_waiting + num_compiling, num_running=scheduler.num_running,
        num_preemptions=scheduler.num_preemptions, num_swap_preemptions=scheduler.num_swap_preemptions,
        num_recompute_preemptions=scheduler.num_preemptions - scheduler.num_swap_preemptions,
        num_requests_finished=counters.num_requests_finished, num_requests_aborted=counters.num_requests_aborted,
        prompt_tokens_total=counters.num_prompt_tokens, batched_tokens_total=counters.num_batched_tokens,
        generation_tokens_total=counters.num_generation_tokens,
        generation_tokens_per_s=counters.generation_tokens_per_s(),
        prefix_cache_hit_rate=pages.prefix_hit_rate, prefix_cache_queried_tokens=pages.num_prefix_queried_tokens,
        prefix_cache_hit_tokens=pages.num_prefix_hit_tokens,
        num_staged_prefills=pages.num_staged_prefills, staging_pages_peak=pages.peak_staging_pages,
        swap_space_bytes=swap.num_bytes if swap is not None else 0,
        swap_space_used_bytes=swap.num_used_bytes if swap is not None else 0,
        num_swapped=swap.num_ranges if swap is not None else 0,
        num_swap_ins=swap.num_swapped_in if swap is not None else 0,
        window_snapshots_taken=snapshots.num_captured if snapshots is not None else 0,
        window_snapshot_hits=snapshots.num_hits if snapshots is not None else 0,
        tensor_parallel_size=tensor_parallel_size,
        kv_bytes_per_rank=sum(pool.num_pages * page_bytes[kind] for kind, pool in pools.items()),
        pools={kind: PoolStats.of(pool) for kind, pool in pools.items()},
        fork_pages_shared={kind: pages.num_fork_pages_shared[kind] for kind in FORK_KINDS},
        fork_pages_copied={kind: pages.num_fork_pages_copied[kind] for kind in FORK_KINDS})
