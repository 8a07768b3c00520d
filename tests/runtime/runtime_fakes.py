"""Test doubles for the bookkeeping: a cache that stores token *identities* instead of K/V.

``IdentityCache`` follows the write rule of docs/cache-format.md (the one ``cache_write``
implements) on a dict per page kind. A position's identity is a hash of all tokens up to it - what
its K/V depends on - so reading every cached position back through the page tables and comparing
identities catches any page shared wrongly, overwritten, freed too early or mislocated.

``standard_only=True`` mimics a writer that ignores ``history_lens`` and derives the ring from
``cache_lens`` alone (the ``oscar::`` ops called without it): used to show why history hits are
opt-in.
"""

from __future__ import annotations

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import FinishReason, Sequence

GARBAGE = "garbage"


class IdentityCache:
    def __init__(self, page_manager: PageManager, standard_only: bool = False):
        self.bm = page_manager
        self.layout = page_manager.layout
        self.standard_only = standard_only
        self.window: dict[tuple[int, int], object] = {}
        self.quant: dict[tuple[int, int], object] = {}
        self.host: dict[tuple, object] = {}  # swap space: (range offset, kind, page index, row)
        self._idents: dict[int, list[int]] = {}

    def ident(self, seq: Sequence, pos: int) -> int:
        idents = self._idents.setdefault(seq.seq_id, [])
        while len(idents) <= pos:
            prev = idents[-1] if idents else 0
            idents.append(hash((prev, seq.token_ids[len(idents)])))
        return idents[pos]

    def _history_len(self, seq: Sequence, L: int) -> int:
        if self.standard_only:
            return self.layout.num_history_tokens(L)
        return self.bm.history_len(seq, L)

    def _where(self, seq: Sequence, pos: int, history_len: int):
        S0, W, P = self.layout.sink, self.layout.recent, self.layout.page_size
        if pos < S0:
            return self.window, (seq.window_pages[pos // P], pos % P)
        if pos < S0 + history_len:
            h = pos - S0
            return self.quant, (seq.quant_pages[h // P], h % P)
        slot = S0 + (pos - S0) % W
        return self.window, (seq.window_pages[slot // P], slot % P)

    def write(self, seq: Sequence, num_new: int) -> None:
        """Cache ``num_new`` tokens of ``seq`` (before the scheduler advances its counters)."""
        L, L_new = seq.num_cached_tokens, seq.num_cached_tokens + num_new
        h, h_new = self._history_len(seq, L), self._history_len(seq, L_new)
        S0 = self.layout.sink
        for pos in range(S0 + h, min(L, S0 + h_new)):  # demote ring tokens that leave
            store, key = self._where(seq, pos, h)
            value = store.get(key, GARBAGE)
            hstore, hkey = self._where(seq, pos, h_new)
            hstore[hkey] = value
        for pos in range(L, L_new):
            store, key = self._where(seq, pos, h_new)
            store[key] = self.ident(seq, pos)

    def swap(self, swap_out, swap_in) -> None:
        """Copy page contents to the host and back, as the runner does for a scheduler output."""
        P = self.layout.page_size
        for copy in swap_out:
            for kind, store, pages in (("w", self.window, copy.window_pages), ("q", self.quant, copy.quant_pages)):
                for j, page in enumerate(pages):
                    for r in range(P):
                        self.host[(copy.offset, kind, j, r)] = store.get((page, r), GARBAGE)
        for copy in swap_in:
            for kind, store, pages in (("w", self.window, copy.window_pages), ("q", self.quant, copy.quant_pages)):
                for j, page in enumerate(pages):
                    for r in range(P):
                        store[(page, r)] = self.host.pop((copy.offset, kind, j, r))

    def copy_pages(self, copy) -> None:
        """Copy page contents for forked choices (a ``PageCopy``), as the runner does."""
        for store, src, dst in ((self.window, copy.window_src, copy.window_dst),
                                (self.quant, copy.quant_src, copy.quant_dst)):
            for s, d in zip(src, dst, strict=True):
                for r in range(self.layout.page_size):
                    store[(d, r)] = store.get((s, r), GARBAGE)

    def take_snapshots(self, out) -> None:
        """The window snapshots a step takes inside its chunks (``SchedulerOutput.snapshot_takes``),
        as the runner does before the step's writes: the ring pages copied, then the chunk's
        tokens of ``[max(L, S0, R - W), R)`` over their slots."""
        S0, W, P = self.layout.sink, self.layout.recent, self.layout.page_size
        for seq, take in out.snapshot_takes:
            ring = seq.window_pages[self.layout.num_sink_pages:]
            page_of = dict(zip(take.ring_pages, take.pages, strict=True))
            for k, page in page_of.items():
                for r in range(P):
                    self.window[(page, r)] = self.window.get((ring[k], r), GARBAGE)
            L, R = seq.num_cached_tokens, take.boundary
            for pos in range(max(L, S0, R - W), R):
                slot = (pos - S0) % W
                if slot // P in page_of:
                    self.window[(page_of[slot // P], slot % P)] = self.ident(seq, pos)

    def check(self, seq: Sequence) -> None:
        """Every cached position reads back its own identity."""
        h = self.bm.history_len(seq)
        for pos in range(seq.num_cached_tokens):
            store, key = self._where(seq, pos, h)
            got = store.get(key, GARBAGE)
            assert got == self.ident(seq, pos), f"{seq} position {pos} reads wrong content"

    def forget(self, seq: Sequence) -> None:
        self._idents.pop(seq.seq_id, None)


def next_token(cache: IdentityCache, seq: Sequence, vocab: int) -> int:
    """A deterministic "greedy model": the next token is a function of the whole context."""
    return cache.ident(seq, seq.num_tokens - 1) % vocab


def check_page_invariants(bm: PageManager, live: list[Sequence]) -> None:
    """Reference counts equal the number of holders; every page is used, cached or free once."""
    for pool, attr in ((bm.window_pool, "window_pages"), (bm.quant_pool, "quant_pages"),
                       (bm.staging_pool, "staging_pages")):
        holders = [0] * pool.num_pages
        for seq in live:
            for page in getattr(seq, attr):
                holders[page] += 1
        assert holders == pool.ref_counts, f"{pool.kind} reference counts drifted"
        free, cached = set(pool._free), set(pool._cached)
        assert len(free) == pool.num_free and not free & cached
        assert all(pool.ref_counts[p] == 0 for p in free | cached)
        assert pool.num_used + pool.num_cached + pool.num_free == pool.num_pages


def run_scheduler(scheduler: Scheduler, cache: IdentityCache, vocab: int = 50,
                  max_steps: int = 100_000) -> dict:
    """Drive the scheduler with the identity cache until all requests finish; checks as it goes."""
    bm = scheduler.page_manager
    live: dict[int, Sequence] = {s.seq_id: s for s in list(scheduler.waiting) + scheduler.running}
    stats = {"steps": 0, "preempted": 0, "max_batch_tokens": 0}
    while scheduler.has_unfinished():
        stats["steps"] += 1
        assert stats["steps"] < max_steps, "no progress"
        out = scheduler.schedule()
        for copy in out.page_copies:  # window snapshots restored into the rings of hits
            cache.copy_pages(copy)
        if out.swap_out or out.swap_in:  # (only with swap space; the identity cache follows the copies)
            cache.swap(out.swap_out, out.swap_in)
        assert out.num_batched_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        arrivals = [s.seq_id for s in scheduler.running]
        assert arrivals == sorted(arrivals)
        assert all(r < w.seq_id for r in arrivals for w in scheduler.waiting)
        stats["preempted"] += len(out.preempted)
        stats["max_batch_tokens"] = max(stats["max_batch_tokens"], out.num_batched_tokens)
        cache.take_snapshots(out)  # before the writes, as the runner does in each layer
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            assert num_new >= 1
            cache.write(seq, num_new)
        for copy in scheduler.advance(out):  # window snapshots taken
            cache.copy_pages(copy)
        for seq in scheduler.running:  # shared pages: a bad write shows up in any holder
            cache.check(seq)
        for seq in out.seqs:
            if seq.num_cached_tokens == seq.num_tokens:
                seq.append_token(next_token(cache, seq, vocab))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    scheduler.finish(seq, FinishReason.LENGTH)
        check_page_invariants(bm, [s for s in live.values() if not s.is_finished])
    return stats
