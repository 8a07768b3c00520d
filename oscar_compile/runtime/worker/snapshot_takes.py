"""Window snapshots taken inside a step (core/window_snapshots.py, "Boundaries").

A chunk ``[L, L + T)`` that passes a snapshot boundary R (``L < R < L + T``) does not stop there,
so the runner builds the ring as it is when the cache holds R tokens from what the layer has
before its cache write: ring slot ``S0 + (p - S0) mod W`` of position p in ``[R - W, R)`` holds
p, which is in the ring before the write when ``p < L`` and is the chunk's own token otherwise.
In every layer, before the write: the ring pages the snapshot is missing are copied into its
pages, then the chunk's keys and values of ``[max(L, S0, R - W), R)`` are written over their
slots, rounded to the window dtype as ``cache_write`` stores them. Every other byte of a page is
the ring's before the write, which a chunk ending at R leaves unchanged too (its write touches
only positions ``>= L``), so the snapshot is bitwise the one a chunk ending at R leaves.

The indices are built once per step from the batch's host lists (no device sync) and reused by
every layer: two ``index_copy_`` and two indexed writes per layer, only in steps that take one.
"""

from __future__ import annotations

import torch

from oscar_compile.runtime.worker.runner import Batch
from oscar_compile.runtime.worker.transfer import to_device


class StepSnapshotTakes:
    """The snapshots a batch takes (``Batch.snapshot_takes``), as device index tensors."""

    def __init__(self, batch: Batch, device: torch.device):
        layout = batch.layout
        S0, W, P = layout.sink, layout.recent, layout.page_size
        cu = batch.cu_seqlens()
        src, dst, rows, pages, offsets = [], [], [], [], []
        for row, take in batch.snapshot_takes:
            L, R = batch.cache_lens[row], take.boundary
            if not L < R < L + len(batch.token_ids[row]):
                raise ValueError(f"row {row} caches [{L}, {L + len(batch.token_ids[row])}): it does not pass "
                                 f"the snapshot boundary {R}")
            ring = batch.window_tables[row][layout.num_sink_pages:]
            src += [ring[k] for k in take.ring_pages]
            dst += take.pages
            page_of = dict(zip(take.ring_pages, take.pages, strict=True))
            for p in range(max(L, S0, R - W), R):  # the chunk's tokens in the ring at R
                slot = (p - S0) % W
                if slot // P in page_of:
                    rows.append(cu[row] + p - L)
                    pages.append(page_of[slot // P])
                    offsets.append(slot % P)
        self.src, self.dst, self.rows, self.pages, self.offsets = (
            to_device(ids, torch.int64, device) for ids in (src, dst, rows, pages, offsets))

    def take(self, k: torch.Tensor, v: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor) -> None:
        """Write one layer's snapshots; call before the layer's cache write.
        k, v: [N, H_kv, D] the step's new keys and values (as the write gets them);
        k_win, v_win: [num_window_pages, H_kv, P, D] the layer's window pools."""
        for x, pool in ((k, k_win), (v, v_win)):
            pool.index_copy_(0, self.dst, pool.index_select(0, self.src))
            pool[self.pages, :, self.offsets] = x.index_select(0, self.rows).to(pool.dtype)
