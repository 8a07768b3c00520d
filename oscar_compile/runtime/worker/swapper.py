"""Copies of page contents between the device pools and host swap space (page_manager, "Swapping").

The host side is one byte arena (pinned on CUDA, so copies are asynchronous DMA); a swapped-out
sequence owns a contiguous range of it (swap_space.py decides where). Inside a range the bytes of
its pages sit tensor by tensor: first its window pages of every window pool tensor (layer by
layer: k_win, v_win), then its history pages of every history pool tensor (codes, scales, zeros;
or the full-precision pages of the BF16 mode). So a copy out is one gather and one slice copy per
pool tensor, a copy in one slice copy and one scatter.

On CUDA the copies run on a side stream that first waits for everything queued on the compute
stream (the last forward may still be writing the pages), and the compute stream waits for the
copies before its next forward (which may reuse the freed pages, or read the swapped-in ones):
no host synchronisation, the host goes on preparing the step. On the CPU the copies are plain.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from oscar_compile.runtime.core.page_manager import SwapCopy


def page_bytes(tensors: Seq[torch.Tensor]) -> int:
    """Bytes one page takes over ``tensors`` (each indexed by page id along dim 0)."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


class HostSwap:
    """``window`` / ``quant``: every pool tensor indexed by window / quant page id (all layers)."""

    def __init__(self, num_bytes: int, window: list[torch.Tensor], quant: list[torch.Tensor],
                 device: torch.device):
        self.device = device
        self.window = [t for t in window if t[0].numel()]
        self.quant = [t for t in quant if t[0].numel()]
        # bytes of one page over all its pools: the pools are fixed, so counted once
        self.window_page_bytes, self.quant_page_bytes = page_bytes(self.window), page_bytes(self.quant)
        # not zero-filled: only ranges written by a swap-out are ever read back (and untouched
        # host pages of an unpinned CPU arena are never committed)
        self.arena = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def swap(self, swap_out: list[SwapCopy], swap_in: list[SwapCopy]) -> None:
        """Queue the copies out, then the copies in (a range freed by a swap-in may be reused by a
        later swap-out: one stream keeps them in order)."""
        if self.stream is None:
            self._copy_all(swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy_all(swap_out, swap_in)
        compute.wait_stream(self.stream)

    def _copy_all(self, swap_out: list[SwapCopy], swap_in: list[SwapCopy]) -> None:
        for copy in swap_out:
            for tensor, pages, start in self._blocks(copy):
                data = tensor.index_select(0, pages).view(torch.uint8).reshape(-1)
                self.arena[start:start + data.numel()].copy_(data, non_blocking=True)
        for copy in swap_in:
            for tensor, pages, start in self._blocks(copy):
                n = pages.numel() * tensor[0].numel() * tensor.element_size()
                data = self.arena[start:start + n]
                # a fresh (aligned) tensor to view as the pool dtype: the copy to the device, or a clone
                data = data.clone() if self.device.type == "cpu" else data.to(self.device, non_blocking=True)
                tensor.index_copy_(0, pages, data.view(tensor.dtype).view(pages.numel(), *tensor.shape[1:]))

    def _blocks(self, copy: SwapCopy):
        """(pool tensor, device page ids, arena byte offset) of every block of a range."""
        start = copy.offset
        for tensors, ids in ((self.window, copy.window_pages), (self.quant, copy.quant_pages)):
            if not ids:
                continue
            pages = torch.tensor(ids, dtype=torch.int64, device=self.device)
            for tensor in tensors:
                yield tensor, pages, start
                start += len(ids) * tensor[0].numel() * tensor.element_size()
