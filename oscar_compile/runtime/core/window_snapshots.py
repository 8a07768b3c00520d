"""Window snapshots: exact prefix-cache hits past the sink under decode-consistent prefill.

Why. Under decode-consistent prefill (formats/prefill.py) the token at position p reads the sink,
the recent window ``[p - W, p)`` at window precision and the history ``[S0, p - W)`` quantized.
A sequence that resumes at a cached prefix ``[0, R)`` therefore needs the window-precision keys
and values of ``[R - W, R)``, and the prefix cache holds those tokens only once they are demoted
to INT-b history: ring pages are overwritten as a sequence advances and are never shared. A
*snapshot* keeps them: a copy of a sequence's ring pages taken when its cache holds exactly R
tokens.

What a snapshot restores. R is a page boundary past the sink, and the sequence is in the standard
state there (docs/cache-format.md): sink ``[0, S0)`` in final sink pages, history ``[S0, R - W)``
in whole history pages (S0, W and R are multiples of P), ring ``[max(S0, R - W), R)`` in the
``W / P`` ring pages. A ring slot depends only on the absolute position (``S0 + (p - S0) mod W``),
so the snapshot copied page for page into the ring of a new sequence at the same R gives it the
state the snapshotted sequence had, no rotation needed. A hit at R shares the sink and history
pages (the prefix cache's blocks) and copies the snapshot into fresh ring pages
(``PageManager.allocate`` returns the ``PageCopy``): the state is standard (no history floor),
and every later token reads exactly what it reads after a miss.

Storage. Snapshot page k of the prefix ``[0, R)`` is a window page registered in the window pool
under :func:`snapshot_hash` of the block hash at R and released, like a cached sink block: it
sits in the pool's LRU of cached pages, counts as available, is evicted before an allocation
fails (admission never waits for a snapshot) and goes with ``reset_prefix_cache``. A snapshot
missing a page is unusable until a sequence reaching the same R captures the missing pages again.
No memory is added: snapshots live in window pages that no running sequence holds.

Boundaries. A sequence is snapshotted when its cache reaches a boundary R (a page boundary,
``R > S0``): the last page boundary before its prompt's last token, ``(n - 1) // P * P`` (a resend
recomputes at most one page), and every multiple of ``interval`` tokens (a longer shared prefix,
a later turn or a recompute after preemption resumes within ``interval`` tokens of where its
cached prefix ends). Chunks follow the step's token budget alone: a boundary never cuts one.
- A chunk ``[L, L + T)`` that passes R (``L < R < L + T``) takes the snapshot inside its step
  (:meth:`WindowSnapshots.plan`, a ``SnapshotTake`` per boundary, planned once the step's
  admissions are done): the state at R is the ring ``[R - W, R)``, whose positions below L are in
  the ring before the step writes, and the others are the chunk's own keys and values. So the
  runner, in every layer before its cache write, copies the ring pages into the snapshot's pages
  and writes the chunk's tokens ``[max(L, S0, R - W), R)`` over their slots, rounded to the window
  dtype as the write stores them: bitwise the snapshot a chunk ending at R would leave.
- A chunk that ends at R leaves the state there: ``Scheduler.advance`` returns the copy of the
  ring (:meth:`WindowSnapshots.capture`), which the runner queues after the step and before the
  next forward writes the ring. (Decode rows reach their boundaries so.)

Cost. A snapshot is W tokens at window precision: ``W / P`` window pages, as many bytes as the
INT-b history of :func:`history_tokens_per_snapshot` tokens. At 8B (36 layers, 8 KV heads,
D = 128, BF16) with W = 256: 37.7 MB, the INT2 history (G = 128, fp16 scale and zero: 20 736 B
a token) of 1820 tokens. The default interval, :func:`default_interval`, is twice that, rounded
up to a page: the snapshots of a sequence then cost at most half its history's bytes, plus the one
at its prompt's end.
"""

from __future__ import annotations

import hashlib
import math

from oscar_compile.formats.cache import CacheLayout
from oscar_compile.runtime.core.page_pool import PagePool
from oscar_compile.runtime.core.page_records import PageCopy, PrefixMatch, SnapshotTake
from oscar_compile.runtime.core.sequence import Sequence


def snapshot_hash(block_hash: bytes, index: int) -> bytes:
    """The key of page ``index`` of the snapshot at the end of the block ``block_hash`` (distinct
    from every block hash: a block hash is never a prefix key)."""
    digest = hashlib.blake2b(block_hash, digest_size=16, person=b"oscar-snapshot")
    digest.update(index.to_bytes(4, "little"))
    return digest.digest()


def history_tokens_per_snapshot(layout: CacheLayout) -> float:
    """How many tokens of history cost the bytes of one snapshot (``W / P`` window pages)."""
    return layout.recent * layout.window_page_bytes / layout.quant_page_bytes


def default_interval(layout: CacheLayout) -> int:
    """Tokens between periodic snapshots: twice :func:`history_tokens_per_snapshot`, in whole pages."""
    P = layout.page_size
    return P * math.ceil(2 * history_tokens_per_snapshot(layout) / P)


class WindowSnapshots:
    """The snapshots of one page manager's window pool (module docstring)."""

    def __init__(self, layout: CacheLayout, window_pool: PagePool, interval: int):
        P = layout.page_size
        if layout.recent == 0:
            raise ValueError("window snapshots need a recent window (W > 0): without one every hit is exact")
        if interval < P or interval % P:
            raise ValueError(f"the snapshot interval must be a positive multiple of the page size {P}, got {interval}")
        self.layout = layout
        self.pool = window_pool
        self.interval = interval
        self.num_pages = layout.recent // P
        self.num_captured = 0  # snapshots (or missing parts of one) copied from a sequence's ring
        self.num_hits = 0  # admissions restored from a snapshot
        # fewest prompt tokens a boundary may leave after it (2 in deterministic mode: page_manager)
        self.min_tail = 1

    @property
    def snapshot_bytes(self) -> int:
        return self.num_pages * self.layout.window_page_bytes

    def is_boundary(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` is snapshotted when its cache holds ``num_tokens`` tokens."""
        P = self.layout.page_size
        if num_tokens % P or num_tokens <= self.layout.sink or not self.leaves_tail(seq, num_tokens):
            return False
        return num_tokens % self.interval == 0 or num_tokens == self.prompt_end(seq)

    def prompt_end(self, seq: Sequence) -> int:
        """The boundary at a prompt's end: the last page boundary that leaves ``min_tail`` tokens."""
        P = self.layout.page_size
        return (seq.num_prompt_tokens - self.min_tail) // P * P

    def leaves_tail(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a snapshot may be taken (and a hit resume) at ``num_tokens``: not within
        ``min_tail`` tokens before the prompt's end."""
        return not 0 < seq.num_prompt_tokens - num_tokens < self.min_tail

    def lookup(self, block_hash: bytes) -> tuple[int, ...] | None:
        """The pages of the snapshot at the end of block ``block_hash``, if every one is cached."""
        pages = []
        for k in range(self.num_pages):  # most boundaries have no snapshot: one hash tells
            page = self.pool.lookup(snapshot_hash(block_hash, k))
            if page is None:
                return None
            pages.append(page)
        return tuple(pages)

    def match(self, seq: Sequence, window: list[int], quant: list[int]) -> PrefixMatch | None:
        """The hit at the latest snapshot of ``seq``'s prefix, given the run of cached blocks found
        (``window``: sink pages, ``quant``: history pages): its history ``[S0, R - W)`` must be in
        that run, and at least the last token is computed (R < n)."""
        layout = self.layout
        S0, W, P = layout.sink, layout.recent, layout.page_size
        if len(window) < layout.num_sink_pages:
            return None
        top = min((seq.num_tokens - 1) // P * P, S0 + len(quant) * P + W)
        for end in range(top, S0, -P):
            pages = self.lookup(seq.block_hashes[end // P - 1]) if self.leaves_tail(seq, end) else None
            if pages is not None:
                num_history = max(0, end - W - S0) // P
                return PrefixMatch(end, tuple(window), tuple(quant[:num_history]), pages)
        return None

    def restore(self, snapshot_pages: tuple[int, ...], ring_pages: list[int]) -> PageCopy:
        """The copy of a hit's snapshot into its fresh ring pages (before its first forward)."""
        self.num_hits += 1
        return PageCopy(tuple(snapshot_pages), tuple(ring_pages), (), ())

    def capture(self, seq: Sequence, num_history: int) -> PageCopy | None:
        """The copy of ``seq``'s ring into the snapshot at its cached length, if that is a boundary,
        the state there is standard (``num_history`` history tokens) and the snapshot is missing
        pages that the pool has room for (never waits: a snapshot is a cache)."""
        L = seq.num_cached_tokens
        if not self.is_boundary(seq, L) or num_history != self.layout.num_history_tokens(L):
            return None
        taken = self._take(seq, L)
        if taken is None:
            return None
        ring = seq.window_pages[self.layout.num_sink_pages :]
        return PageCopy(tuple(ring[k] for k in taken.ring_pages), taken.pages, (), ())

    def plan(self, seq: Sequence, num_new: int) -> list[SnapshotTake]:
        """The snapshots ``seq``'s chunk of ``num_new`` tokens after its cached ones takes inside
        its step: at the boundaries it passes before its end, where the state is standard
        (module docstring, "Boundaries"). Call once the step's admissions are done: a snapshot
        takes only pages that no admission wanted."""
        layout, interval = self.layout, self.interval
        L = seq.num_cached_tokens
        ends = [*range((max(L, layout.sink) // interval + 1) * interval, L + num_new, interval), self.prompt_end(seq)]
        takes = []
        for end in sorted({end for end in ends if L < end < L + num_new}):
            if self.is_boundary(seq, end) and (layout.num_history_tokens(end, seq.history_floor)
                                               == layout.num_history_tokens(end)):
                taken = self._take(seq, end)
                if taken is not None:
                    takes.append(taken)
        return takes

    def _take(self, seq: Sequence, boundary: int) -> SnapshotTake | None:
        """Register fresh pages for the missing pages of the snapshot at ``boundary`` of ``seq``
        (None: none missing, or no room). Their content is written before any later step's
        forward or copy can read it: the capture's copy or the step's take is queued first."""
        pool = self.pool
        keys = [snapshot_hash(seq.block_hashes[boundary // self.layout.page_size - 1], k)
                for k in range(self.num_pages)]
        present = [page for page in map(pool.lookup, keys) if page is not None]
        missing = [k for k, key in enumerate(keys) if pool.lookup(key) is None]
        num_evictable = sum(1 for page in present if pool.is_cached_unused(page))
        if not missing or pool.num_available - num_evictable < len(missing):
            return None
        for page in present:  # so that the fresh pages below do not evict them
            pool.acquire(page)
        dst = [pool.allocate() for _ in missing]
        for k, page in zip(missing, dst, strict=True):
            pool.register(page, keys[k])
        for page in present + dst:
            pool.release(page)
        self.num_captured += 1
        return SnapshotTake(boundary, tuple(missing), tuple(dst))
