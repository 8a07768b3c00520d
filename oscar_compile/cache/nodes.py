"""The two graph nodes of a rewritten attention layer, around the ``oscar::`` ops.

``layer_inputs`` asks the cache the model runs with for the ops' inputs, ``layer_outputs`` gives
it their output; a cache is anything implementing
:class:`~oscar_compile.cache.contract.PagedAttentionCache`. Kept apart from the contract so the
contract imports no cache implementation: a forward without a paged cache falls back to a
throwaway HF cache layer (``hf_cache``), which itself implements the contract.
"""
from __future__ import annotations

import torch

from ..formats.cache import LayerFormat
from .contract import PagedAttentionCache
from .hf_cache import uncached_layer_inputs, uncached_layer_outputs


def layer_inputs(cache: object | None, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 **layer_fields) -> tuple:
    """Graph node: the op inputs for the new tokens (see ``contract.layer_input_names``).

    ``layer_fields`` are the :class:`LayerFormat` of the layer, as keyword constants of the node.
    Without a paged cache (a forward with ``use_cache=False``) the chunk attends within itself
    and nothing is kept: a throwaway HF layer provides the pools.
    """
    layer = LayerFormat(**layer_fields)
    if isinstance(cache, PagedAttentionCache):
        return cache.oscar_layer_inputs(layer_idx, q, k, v, layer)
    return uncached_layer_inputs(q, k, v, layer)


def layer_outputs(cache: object | None, layer_idx: int, out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Graph node: scatter the ops' output [N, H_q, D] back and advance the cache lengths."""
    if isinstance(cache, PagedAttentionCache):
        return cache.oscar_layer_outputs(layer_idx, out, q)
    return uncached_layer_outputs(out, q)
