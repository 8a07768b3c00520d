"""The graph-to-cache contract: what a rewritten attention graph asks of whatever cache it runs on.

``apply`` rewrites each attention layer into ``layer_inputs -> oscar::attention ->
oscar::cache_write -> layer_outputs`` (the two graph nodes of ``oscar_compile.cache.nodes``),
which hand the padded ``[B, H, T, D]``
tensors Hugging Face uses to the cache and get back the flat token lists and cache tensors the
ops take, and back. Two caches implement :class:`PagedAttentionCache`: the HF cache behind
``generate()`` (``oscar_compile.cache.hf_cache.OscarCache``) and the serving runtime's
``StepCache`` over its own pages. Both sit above this module, so neither the passes nor the
runtime import the other.

The tuple a cache returns is named here once (:func:`layer_input_names`), so the pass that wires
the ops reads its items by name instead of counting them.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..formats.cache import LayerFormat
from ..kernels.pools import CachePools

QKV_INPUTS = ("q", "k", "v", "cu_seqlens")  # q: [N, H_q, D]; k, v: [N, H_kv, D]; cu_seqlens: [B + 1] int32
# the cache tensors of each layer kind, in the oscar:: ops' argument order
FULL_PRECISION_CACHE_INPUTS = ("cache_lens", "page_table", "k_pages", "v_pages")
WINDOWED_CACHE_INPUTS = ("cache_lens", "window_table", "quant_table", *CachePools._fields)


def cache_input_names(layer: LayerFormat) -> tuple[str, ...]:
    """The cache tensors the ops of ``layer`` read and write."""
    return FULL_PRECISION_CACHE_INPUTS if layer.full_precision_pages else WINDOWED_CACHE_INPUTS


def layer_input_names(layer: LayerFormat) -> tuple[str, ...]:
    """The items of :meth:`PagedAttentionCache.oscar_layer_inputs`, in order.

    ``write_cu`` is ``cu_seqlens`` when there is a cache to write, all zeros when nothing is
    kept. ``history_lens`` ([B] int32 or None, windowed layers only) is None when every row's
    ring is in the standard state, else each sequence's history length (a runtime row may start
    after a prefix-cache hit)."""
    tail = ("write_cu",) if layer.full_precision_pages else ("write_cu", "history_lens")
    return (*QKV_INPUTS, *cache_input_names(layer), *tail)


@runtime_checkable
class PagedAttentionCache(Protocol):
    """A cache the rewritten attention graphs can run on."""

    def oscar_layer_inputs(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           layer: LayerFormat) -> tuple:
        """The op inputs of :func:`layer_input_names` for the new tokens of this forward
        (q: [B, H_q, T, D]; k, v: [B, H_kv, T, D], rotated), pages reserved for them."""
        ...

    def oscar_layer_outputs(self, layer_idx: int, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """The ops' output [N, H_q, D] in the layout the model continues with; advance lengths."""
        ...


__all__ = ["PagedAttentionCache", "layer_input_names", "cache_input_names"]
