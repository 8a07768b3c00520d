"""How a memory budget becomes page counts for the paged KV cache.

The cache (docs/cache-format.md) has two kinds of pages, each a fixed pool shared by all layers
(page ``i`` of a kind is row ``i`` of that kind's pool in every layer):

- **window pages** hold full-precision tokens: the ``S0`` sink tokens and the ring of the ``W``
  most recent tokens. Every sequence owns ``(S0 + W) / P`` of them from admission to finish.
- **quant pages** hold ``P`` history tokens each (positions ``[S0, L - W)``), one more every ``P``
  demoted tokens. A layer the spec keeps at 16 bits stores its history rows in full precision, so
  a quant page is bigger than ``P`` INT-b tokens when such layers exist; the page ids stay the same
  for every layer, only the per-layer pool dtype differs.

What a page holds and costs is :class:`~oscar_compile.formats.cache.CacheLayout` (re-exported
here, where the runtime always found it); this module only splits a budget between the kinds.
"""

from __future__ import annotations

from dataclasses import dataclass

from oscar_compile.formats.cache import SCALE_DTYPE_BYTES, CacheLayout, LayerFormat  # noqa: F401  (re-exported)

GIB = 1024**3


@dataclass(frozen=True)
class PagePlan:
    num_window_pages: int
    num_quant_pages: int


def plan_pages(layout: CacheLayout, kv_memory_bytes: int, max_num_seqs: int,
               expected_seq_len: int) -> PagePlan:
    """Split a KV memory budget into window and quant pages.

    The split is fixed at start-up because each kind is a preallocated pool per layer. Window pages
    cap how many sequences run at once, quant pages cap how many tokens of history fit in total;
    sizing both for ``expected_seq_len`` tokens per sequence balances them at that length (shorter
    sequences leave history unused, longer ones run fewer at a time). The windows of at least one
    sequence always fit, or the budget is refused.
    """
    if kv_memory_bytes <= 0:
        raise ValueError(f"kv memory must be > 0 bytes, got {kv_memory_bytes}")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    num_window, num_quant = layout.num_pages_for_seq(max(expected_seq_len, 1))
    window_bytes = num_window * layout.window_page_bytes
    seq_bytes = window_bytes + num_quant * layout.quant_page_bytes
    num_seqs = min(max_num_seqs, kv_memory_bytes // seq_bytes) if seq_bytes else max_num_seqs
    if window_bytes and num_seqs < 1:
        if kv_memory_bytes < window_bytes:
            raise ValueError(
                f"kv memory of {kv_memory_bytes / GIB:.3f} GiB cannot hold the windows of one "
                f"sequence ({window_bytes / GIB:.3f} GiB)"
            )
        num_seqs = 1
    num_window_pages = num_seqs * num_window
    left = kv_memory_bytes - num_window_pages * layout.window_page_bytes
    num_quant_pages = left // layout.quant_page_bytes
    if num_quant_pages < 1:
        raise ValueError(
            f"kv memory of {kv_memory_bytes / GIB:.3f} GiB leaves no room for a history page "
            f"({layout.quant_page_bytes} bytes)"
        )
    return PagePlan(num_window_pages, int(num_quant_pages))
