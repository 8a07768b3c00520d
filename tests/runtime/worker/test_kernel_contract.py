"""The runtime's page tables drive the kernels' reference ``cache_write`` correctly.

Each token's key is a constant vector holding an identity value (a hash of its context). A
constant group quantizes exactly (scale 1, code 0, zero = -value), so the history can be read
back bit-exact through ``gather_cached`` - the reference attention's own reader - and compared,
across chunked prefill, preemption and prefix hits (past the sink too: the op gets the block
manager's history length as ``history_lens``).
"""

from __future__ import annotations

import random

import pytest
import torch
from runtime_fakes import IdentityCache, run_scheduler

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.page_plan import CacheLayout
from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import Sequence

cache_write_ref = pytest.importorskip("oscar_compile.kernels.cache_write.cache_write_ref").cache_write_ref
gather_cached = pytest.importorskip("oscar_compile.kernels.attention.decode.attention_ref").gather_cached
allocate_pools = pytest.importorskip("oscar_compile.kernels.pools").allocate_pools

P, D = 16, 8


class KernelCache:
    """Same interface as IdentityCache, backed by real pools and the reference op.

    ``standard_only=True`` leaves ``history_lens`` out: the op then derives the ring from
    ``cache_lens`` alone, which is wrong right after a hit past the sink.
    """

    def __init__(self, bm: PageManager, standard_only: bool = False):
        self.bm = bm
        self.standard_only = standard_only
        self.layout = bm.layout
        self.ids = IdentityCache(bm)
        self.pools = allocate_pools(bm.quant_pool.num_pages, max(bm.window_pool.num_pages, 1), 1, P, D,
                                    bits=2, group_size=D, scale_dtype=torch.float32,
                                    window_dtype=torch.float32)

    def ident(self, seq: Sequence, pos: int) -> int:
        return self.ids.ident(seq, pos)

    def value(self, seq: Sequence, pos: int) -> float:
        return float(self.ident(seq, pos) % 1000 + 1)

    def _tables(self, seq: Sequence):
        window = torch.tensor([seq.window_pages or [0]], dtype=torch.int32)
        quant = torch.tensor([seq.quant_pages or [0]], dtype=torch.int32)
        return window, quant

    def _history_lens(self, seq: Sequence) -> torch.Tensor | None:
        return None if self.standard_only else torch.tensor([self.bm.history_len(seq)], dtype=torch.int32)

    def write(self, seq: Sequence, num_new: int) -> None:
        L = seq.num_cached_tokens
        k = torch.tensor([self.value(seq, p) for p in range(L, L + num_new)]).view(-1, 1, 1).expand(-1, 1, D)
        window, quant = self._tables(seq)
        cache_write_ref(k.contiguous(), (-k).contiguous(), torch.tensor([0, num_new], dtype=torch.int32),
                        torch.tensor([L], dtype=torch.int32), window, quant, *self.pools,
                        self.layout.sink, self.layout.recent, 2, D, 1.0, 1.0, self._history_lens(seq))

    def take_snapshots(self, out) -> None:
        assert not out.snapshot_takes  # these page managers keep no window snapshots

    def check(self, seq: Sequence) -> None:
        L = seq.num_cached_tokens
        window, quant = self._tables(seq)
        pools = self.pools
        history_lens = self._history_lens(seq)
        h = None if history_lens is None else int(history_lens)
        for kind, win, codes, scale, zero, sign in (
                ("k", pools.k_win, pools.k_codes, pools.k_scale, pools.k_zero, 1),
                ("v", pools.v_win, pools.v_codes, pools.v_scale, pools.v_zero, -1)):
            got = gather_cached(0, L, window, quant, win, codes, scale, zero,
                                self.layout.sink, self.layout.recent, 2, D, h, kind=kind)
            expected = torch.tensor([sign * self.value(seq, p) for p in range(L)])
            assert torch.equal(got[:, 0, :], expected[:, None].expand(L, D)), f"{seq} reads wrong content"


@pytest.mark.parametrize("sink, recent", [(16, 32), (0, 16), (32, 0), (0, 0)])
@pytest.mark.parametrize("num_quant", [10, 300])
@pytest.mark.parametrize("history_hits", [False, True])
def test_reference_cache_write_reads_back_every_token(sink, recent, num_quant, history_hits):
    rng = random.Random(sink * 7 + recent + num_quant)
    layout = CacheLayout.uniform(num_layers=1, num_kv_heads=1, head_dim=D, group_size=D, page_size=P,
                                 sink=sink, recent=recent)
    bm = PageManager(layout, 6 * max(1, (sink + recent) // P), num_quant, history_hits=history_hits)
    scheduler = Scheduler(bm, max_num_seqs=5, max_num_batched_tokens=rng.choice([9, 50]))
    stem = [rng.randrange(40) for _ in range(90)]
    for _ in range(12):
        prompt = stem[: rng.randrange(1, 90)] + [rng.randrange(40) for _ in range(rng.randrange(0, 30))]
        max_tokens = rng.randrange(1, 30)
        if bm.can_ever_fit(len(prompt) + max_tokens):
            scheduler.add(Sequence(prompt, SamplingParams(max_tokens=max_tokens)))
    run_scheduler(scheduler, KernelCache(bm))
    assert bm.quant_pool.num_used == 0 and bm.window_pool.num_used == 0


@pytest.mark.parametrize("standard_only", [False, True])
def test_history_hits_need_history_lens(standard_only):
    """After a hit past the sink the ring is empty: given history_lens the op leaves the shared
    history alone; without it, it demotes stale ring slots into the shared pages."""
    layout = CacheLayout.uniform(num_layers=1, num_kv_heads=1, head_dim=D, group_size=D, page_size=P,
                                 sink=16, recent=32)
    bm = PageManager(layout, 6, 20, history_hits=True)
    cache = KernelCache(bm, standard_only)
    a, b = Sequence(list(range(100))), Sequence(list(range(100)) + [3] * 40)
    for seq in (a, b):
        match = bm.match_prefix(seq)
        bm.allocate(seq, match)
        num_new = seq.num_tokens - match.num_tokens
        bm.may_append(seq, num_new)
        cache.write(seq, num_new)
        seq.num_cached_tokens += num_new
        bm.commit(seq)
    assert b.num_prefix_cached_tokens == 64
    if standard_only:
        with pytest.raises(AssertionError, match="wrong content"):
            cache.check(a)
    else:
        cache.check(a)
        cache.check(b)
