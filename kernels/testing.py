"""Test helpers that ship with the package: random paged caches built through the write op.

Used by tests/kernels and by the benchmark's correctness check. A case holds the pools, the page
tables (pages handed out in a shuffled order, so a kernel that assumes contiguous pages fails),
and the token streams that were written, so a test can rebuild the dense cache independently;
optionally the state after prefix-cache hits past the sink (``history_lens``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from oscar_compile.formats.op_args import CacheWriteArgs
from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.pools import (
    CachePools,
    allocate_pools,
    num_quant_pages_needed,
    num_window_pages_per_seq,
)


@dataclass
class CacheCase:
    pools: CachePools
    window_table: torch.Tensor  # [B, (S0 + W) / P] int32
    quant_table: torch.Tensor  # [B, max_quant_pages] int32
    cache_lens: torch.Tensor  # [B] int32
    keys: list[torch.Tensor]  # per sequence [L_i, H_kv, D] window dtype, what was written
    values: list[torch.Tensor]
    sink: int
    recent: int
    bits: int
    group_size: int
    clip_k: float
    clip_v: float
    history_lens: torch.Tensor | None = None  # [B] int32 h per sequence, None: the standard state

    @property
    def page_size(self) -> int:
        return self.pools.k_win.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """Record that the new tokens k, v: [N, H_kv, D] were written: streams, lengths, history."""
        cu = cu_seqlens.tolist()
        for i in range(len(self.keys)):
            self.keys[i] = torch.cat([self.keys[i], k[cu[i]:cu[i + 1]].to(self.keys[i])])
            self.values[i] = torch.cat([self.values[i], v[cu[i]:cu[i + 1]].to(self.values[i])])
        self.cache_lens += (cu_seqlens[1:] - cu_seqlens[:-1]).to(self.cache_lens)
        if self.history_lens is not None:
            standard = (self.cache_lens - self.recent - self.sink).clamp_min(0)
            self.history_lens = torch.maximum(self.history_lens, standard).to(torch.int32)


def random_kv(n: int, num_kv_heads: int, head_dim: int, generator: torch.Generator,
              dtype: torch.dtype = torch.bfloat16, device="cpu") -> torch.Tensor:
    """[n, H_kv, D] with a few large channels and per-token spread, like rotated keys before clipping."""
    x = torch.randn(n, num_kv_heads, head_dim, generator=generator)
    chan = 1 + 4 * (torch.rand(num_kv_heads, head_dim, generator=generator) > 0.95)
    tok = torch.rand(n, 1, 1, generator=generator) + 0.5
    return (x * chan * tok).to(device=device, dtype=dtype)


def make_tables(cache_lens_after: list[int], sink: int, recent: int, page_size: int,
                generator: torch.Generator, extra_pages: int = 1):
    """Shuffled page tables big enough for each sequence to hold ``cache_lens_after`` tokens."""
    B = len(cache_lens_after)
    n_w = num_window_pages_per_seq(sink, recent, page_size)
    need = [num_quant_pages_needed(L, sink, recent, page_size) for L in cache_lens_after]
    width = max(need + [0]) + extra_pages
    num_q = sum(need) + extra_pages
    wperm = torch.randperm(max(B * n_w, 1), generator=generator).to(torch.int32)
    window_table = wperm[: B * n_w].view(B, n_w).contiguous()
    qperm = torch.randperm(num_q, generator=generator).to(torch.int32)
    quant_table = torch.zeros(B, width, dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        quant_table[i, :n] = qperm[start:start + n]
        start += n
    return window_table, quant_table, max(B * n_w, 1), num_q


def build_case(
    cache_lens: list[int], num_kv_heads: int, head_dim: int, page_size: int = 16, sink: int = 16,
    recent: int = 32, bits: int = 2, group_size: int = 128, scale_dtype=torch.float16,
    window_dtype=torch.bfloat16, clip_k: float = 0.96, clip_v: float = 0.92, seed: int = 0,
    chunk: int | None = None, extra_tokens: int = 0, write: Callable = cache_write_ref,
    device="cpu", hits: list[int] | None = None,
) -> CacheCase:
    """Write random streams of ``cache_lens[i]`` tokens per sequence through ``write``.

    ``chunk``: tokens per write call and sequence (None: one bulk call). ``extra_tokens``: room
    in the tables for that many more tokens per sequence (for a following write / attention).
    ``hits``: sequence i starts as after a prefix-cache hit on its first ``hits[i]`` tokens
    (page_manager): sink ``[0, S0)`` and history ``[S0, hits[i])`` written in one call with
    W = 0 (each history row quantized as a demotion would), ring slots full of stale garbage
    (large values: a kernel that reads or demotes one fails loudly); the rest is then written
    (``chunk`` as above) with ``history_lens`` = max(hits[i] - S0, L - W - S0), and
    ``case.history_lens`` holds the final h. ``hits[i] <= S0`` gives the standard state.
    """
    gen = torch.Generator().manual_seed(seed)
    B, H, D = len(cache_lens), num_kv_heads, head_dim
    if hits is not None and any(not 0 <= R <= L for R, L in zip(hits, cache_lens, strict=True)):
        raise ValueError(f"hits {hits} must lie in [0, cache_lens {cache_lens}]")
    floors = [max(0, R - sink) for R in hits or [0] * B]
    # room for max(floor, L - W - S0) history tokens: a floor counts like S0 + W + floor tokens
    room = [max(L + extra_tokens, sink + recent + f) for L, f in zip(cache_lens, floors, strict=True)]
    wt, qt, n_w, n_q = make_tables(room, sink, recent, page_size, gen)
    pools = allocate_pools(n_q, n_w, H, page_size, D, bits, group_size, scale_dtype, window_dtype, device)
    keys = [random_kv(L, H, D, gen, window_dtype, device) for L in cache_lens]
    values = [random_kv(L, H, D, gen, window_dtype, device) for L in cache_lens]
    wt, qt = wt.to(device), qt.to(device)
    history_lens = None
    if hits is not None:
        h = [max(f, L - recent - sink, 0) for f, L in zip(floors, cache_lens, strict=True)]
        history_lens = torch.tensor(h, dtype=torch.int32, device=device)
    case = CacheCase(pools, wt, qt, torch.tensor(cache_lens, dtype=torch.int32, device=device),
                     keys, values, sink, recent, bits, group_size, clip_k, clip_v, history_lens)
    if hits is None:
        _write_streams(case, write, [0] * B, chunk, recent)
        return case
    start = [min(sink + f, L) for f, L in zip(floors, cache_lens, strict=True)]
    _write_streams(case, write, [0] * B, None, 0, stop=start)  # sink + shared history, no ring
    for i in range(B):  # stale ring slots (pages a previous owner left behind)
        ring = wt[i, sink // page_size:].long()
        pools.k_win[ring] = 1000.0
        pools.v_win[ring] = -1000.0
    _write_streams(case, write, start, chunk, recent, floors=floors)
    return case


def _write_streams(case: CacheCase, write: Callable, start: list[int], step: int | None,
                   recent: int, stop: list[int] | None = None, floors: list[int] | None = None) -> None:
    """Write positions [start[i], stop[i]) (default: the whole stream) of every sequence through
    ``write`` with W = ``recent``, ``step`` tokens per call and sequence (None: one call). With
    history ``floors``: passes history_lens = max(floor, L - W - S0)."""
    B, sink, device = len(case.keys), case.sink, case.pools.k_win.device
    stop = [len(x) for x in case.keys] if stop is None else stop
    done = list(start)
    step = step or max(stop + [1])
    while any(d < L for d, L in zip(done, stop, strict=True)):
        take = [min(step, L - d) for d, L in zip(done, stop, strict=True)]
        ks = [case.keys[i][done[i]:done[i] + take[i]] for i in range(B)]
        vs = [case.values[i][done[i]:done[i] + take[i]] for i in range(B)]
        cu = torch.tensor([0] + take, dtype=torch.int32).cumsum(0).to(torch.int32)
        lens = torch.tensor(done, dtype=torch.int32)
        extra = {}
        if floors is not None:
            h = [max(f, d - recent - sink) for f, d in zip(floors, done, strict=True)]
            extra["history_lens"] = torch.tensor(h, dtype=torch.int32, device=device)
        write(torch.cat(ks), torch.cat(vs), cu.to(device), lens.to(device), case.window_table,
              case.quant_table, *case.pools, sink, recent, case.bits, case.group_size, case.clip_k,
              case.clip_v, **extra)
        done = [d + t for d, t in zip(done, take, strict=True)]


def with_standard_history_lens(write: Callable) -> Callable:
    """``write`` given ``history_lens`` = the standard max(0, L - W - S0) explicitly (changes nothing)."""

    def call(*args, **kwargs):
        a = CacheWriteArgs(*args, **kwargs)  # the oscar::cache_write arguments, by name
        h = (a.cache_lens - a.recent - a.sink).clamp_min(0).to(torch.int32)
        return write(*args, history_lens=h, **kwargs)

    return call
