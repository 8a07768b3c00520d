"""A fixed set of page ids of one kind: reference counts, a free list and the prefix cache.

A page is in exactly one of three states:
- **used**: referenced by at least one sequence (``ref_counts[page] > 0``);
- **cached**: unreferenced but holding a registered block (hash -> page), kept for prefix reuse
  and evicted least-recently-released first when a fresh page is needed;
- **free**: unreferenced and holding nothing worth keeping.
A used page referenced by more than one sequence (a prefix-cache hit, or a prompt page of the
choices of one request: page_manager, "Parallel sampling") is *shared*: ``num_shared`` counts them.
Fresh pages come from the free list first so cached content lives as long as possible.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

logger = logging.getLogger(__name__)


class PagePool:
    def __init__(self, kind: str, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.kind = kind
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        self.num_evictions = 0
        self.num_shared = 0  # pages with more than one reference (kept as they change: read each step)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages a new allocation can take (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages that still hold a reusable block."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_available

    def allocate(self) -> int:
        """Take a fresh page with one reference; evicts the least recently released cached page."""
        if self._free:
            page = self._free.popleft()
        elif self._cached:
            page, _ = self._cached.popitem(last=False)
            del self._page_of_hash[self._hash_of_page.pop(page)]
            self.num_evictions += 1
        else:
            raise RuntimeError(f"no {self.kind} page left: check can_allocate/can_append first")
        self.ref_counts[page] = 1
        return page

    def lookup(self, block_hash: bytes) -> int | None:
        return self._page_of_hash.get(block_hash)

    def is_cached_unused(self, page: int) -> bool:
        return page in self._cached

    def acquire(self, page: int) -> None:
        """Add a reference to a page found by ``lookup`` (takes it out of the eviction list)."""
        if self.ref_counts[page] == 0:
            if page not in self._cached:
                raise RuntimeError(f"{self.kind} page {page} is free, it cannot be shared")
            del self._cached[page]
        self.ref_counts[page] += 1
        self.num_shared += self.ref_counts[page] == 2

    def release(self, page: int) -> None:
        if self.ref_counts[page] <= 0:
            raise RuntimeError(f"{self.kind} page {page} released more times than referenced")
        self.ref_counts[page] -= 1
        self.num_shared -= self.ref_counts[page] == 1
        if self.ref_counts[page] == 0:
            if page in self._hash_of_page:
                self._cached[page] = None
            else:
                self._free.append(page)

    def register(self, page: int, block_hash: bytes) -> bool:
        """Publish a page whose content is final under ``block_hash``; False if already known.

        Two sequences that computed the same block concurrently both hold a copy; the first one
        registered wins and the other stays private (freed, not cached, when released).
        """
        if block_hash in self._page_of_hash or page in self._hash_of_page:
            return False
        self._page_of_hash[block_hash] = page
        self._hash_of_page[page] = block_hash
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every unreferenced cached block (e.g. after the weights change); returns how many."""
        num_dropped = len(self._cached)
        for page in self._cached:
            del self._page_of_hash[self._hash_of_page.pop(page)]
            self._free.append(page)
        self._cached.clear()
        logger.info("dropped %d cached %s pages", num_dropped, self.kind)
        return num_dropped
