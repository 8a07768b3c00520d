"""Test helpers that ship with the package: random paged caches built through the write op.

Used by tests/kernels and by the benchmark's correctness check. A case holds the pools, the page
tables (pages handed out in a shuffled order, so a kernel that assumes contiguous pages fails),
and the token streams that were written, so a test can rebuild the dense cache independently.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oscar_compile.kernels.cache_write_ref import cache_write_ref
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

    @property
    def page_size(self) -> int:
        return self.pools.k_win.shape[2]


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
    device="cpu",
) -> CacheCase:
    """Write random streams of ``cache_lens[i]`` tokens per sequence through ``write``.

    ``chunk``: tokens per write call and sequence (None: one bulk call). ``extra_tokens``: room
    in the tables for that many more tokens per sequence (for a following write / attention).
    """
    gen = torch.Generator().manual_seed(seed)
    B, H, D = len(cache_lens), num_kv_heads, head_dim
    wt, qt, n_w, n_q = make_tables([L + extra_tokens for L in cache_lens], sink, recent, page_size, gen)
    pools = allocate_pools(n_q, n_w, H, page_size, D, bits, group_size, scale_dtype, window_dtype, device)
    keys = [random_kv(L, H, D, gen, window_dtype, device) for L in cache_lens]
    values = [random_kv(L, H, D, gen, window_dtype, device) for L in cache_lens]
    wt, qt = wt.to(device), qt.to(device)
    done = [0] * B
    step = chunk or max(cache_lens + [1])
    while any(d < L for d, L in zip(done, cache_lens)):
        take = [min(step, L - d) for d, L in zip(done, cache_lens)]
        ks = [keys[i][done[i]:done[i] + take[i]] for i in range(B)]
        vs = [values[i][done[i]:done[i] + take[i]] for i in range(B)]
        cu = torch.tensor([0] + take, dtype=torch.int32).cumsum(0).to(torch.int32)
        lens = torch.tensor(done, dtype=torch.int32)
        write(torch.cat(ks), torch.cat(vs), cu.to(device), lens.to(device), wt, qt, *pools,
              sink, recent, bits, group_size, clip_k, clip_v)
        done = [d + t for d, t in zip(done, take)]
    return CacheCase(pools, wt, qt, torch.tensor(cache_lens, dtype=torch.int32, device=device),
                     keys, values, sink, recent, bits, group_size, clip_k, clip_v)
