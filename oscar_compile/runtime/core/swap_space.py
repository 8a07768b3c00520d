"""Host swap space bookkeeping: contiguous byte ranges of one host arena, first fit.

A preempted sequence's pages (window pages, then history pages, every layer) are copied into one
contiguous range of a pinned host buffer that the runner owns (runtime/worker/swapper.py), and back into
fresh device pages before it runs again. A contiguous range makes each copy one slice per pool
tensor instead of a scatter, so both directions stay asynchronous. This module only decides where
ranges go; it holds no tensors (tested on any machine).

Ranges are rounded up to ``ALIGN`` bytes so every sub-block the runner lays out inside a range
starts aligned. Freed ranges are merged with their free neighbours; a request that finds no free
range large enough is refused (the caller then recomputes instead of swapping).
"""

from __future__ import annotations

import bisect

ALIGN = 512


class SwapSpace:
    """First-fit allocator over ``num_bytes`` of host memory, in units of page bytes."""

    def __init__(self, num_bytes: int, window_page_bytes: int, quant_page_bytes: int):
        if num_bytes < 0:
            raise ValueError(f"swap space must be >= 0 bytes, got {num_bytes}")
        self.num_bytes = num_bytes - num_bytes % ALIGN
        self.window_page_bytes = window_page_bytes
        self.quant_page_bytes = quant_page_bytes
        self._free: list[tuple[int, int]] = [(0, self.num_bytes)] if self.num_bytes else []  # (offset, size)
        self._used: dict[int, int] = {}  # offset -> size
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    @property
    def num_used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def num_ranges(self) -> int:
        """Ranges held (one per swapped-out sequence)."""
        return len(self._used)

    def range_bytes(self, num_window: int, num_quant: int) -> int:
        """Bytes a sequence of ``num_window`` window and ``num_quant`` history pages takes."""
        size = num_window * self.window_page_bytes + num_quant * self.quant_page_bytes
        return -(-size // ALIGN) * ALIGN

    def can_fit(self, num_window: int, num_quant: int) -> bool:
        size = self.range_bytes(num_window, num_quant)
        return size > 0 and any(s >= size for _, s in self._free)

    def allocate(self, num_window: int, num_quant: int) -> int:
        """The offset of a fresh range for that many pages; RuntimeError if none fits."""
        size = self.range_bytes(num_window, num_quant)
        for i, (offset, free) in enumerate(self._free):
            if free >= size and size > 0:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._used[offset] = size
                self.num_swapped_out += 1
                return offset
        raise RuntimeError(f"no {size}-byte range left in the swap space: check can_fit first")

    def free(self, offset: int) -> None:
        """Give a range back (after its sequence swapped in, or ended while swapped out)."""
        size = self._used.pop(offset, None)
        if size is None:
            raise RuntimeError(f"swap range at {offset} is not allocated")
        i = bisect.bisect(self._free, (offset, size))
        self._free.insert(i, (offset, size))
        # merge with the right, then the left neighbour
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def is_empty(self) -> bool:
        """Nothing allocated and the free list back to one range."""
        return not self._used and self._free == ([(0, self.num_bytes)] if self.num_bytes else [])
