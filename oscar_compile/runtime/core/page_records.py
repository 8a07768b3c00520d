"""The plain records the page manager hands out: what an admission reuses (``PrefixMatch``) and
the page copies the runner makes before the next forward (``PageCopy``: forked choices, window
snapshots; ``SwapCopy``: host swap space) and the window snapshots it takes inside a step
(``SnapshotTake``). Their own module so that page_manager.py and
window_snapshots.py, which both make them, need not import each other both ways."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    """Cached blocks a sequence can reuse, its first ``num_tokens`` tokens: without
    ``snapshot_pages``, ``(len(window) + len(quant)) * P`` (the ring starts empty); with them, the
    ring pages of a window snapshot at ``num_tokens`` (window_snapshots.py)."""

    num_tokens: int = 0
    window_pages: tuple[int, ...] = ()
    quant_pages: tuple[int, ...] = ()
    snapshot_pages: tuple[int, ...] = ()


@dataclass(frozen=True)
class PageCopy:
    """Device copies into fresh pages (a fork's; a window snapshot taken or restored): page
    ``window_src[k]`` into ``window_dst[k]`` (and so for quant), every layer."""

    window_src: tuple[int, ...]
    window_dst: tuple[int, ...]
    quant_src: tuple[int, ...]
    quant_dst: tuple[int, ...]


@dataclass(frozen=True)
class SwapCopy:
    """Pages to copy to (swap out) or from (swap in) the host range at byte ``offset``: window
    pages first, then history pages, in the sequence's table order."""

    offset: int
    window_pages: tuple[int, ...]
    quant_pages: tuple[int, ...]


@dataclass(frozen=True)
class SnapshotTake:
    """A window snapshot taken inside a step (window_snapshots.py, "Boundaries"): the step's chunk
    of a sequence passes ``boundary``, and the runner writes ring page ``ring_pages[j]`` (an index
    into the ring) as it is when the cache holds ``boundary`` tokens into window page ``pages[j]``,
    every layer, before the layer's cache write."""

    boundary: int
    ring_pages: tuple[int, ...]
    pages: tuple[int, ...]
