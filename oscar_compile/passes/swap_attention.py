"""Replace the cache update + attention call of a traced layer.

Quantized layers: the model's attention becomes ``oscar::attention`` over the mixed INT-b /
full-precision cache followed by ``oscar::cache_write`` of the new tokens (attention first: the
chunk attends to its own keys in full precision, as serving engines prefill). 16-bit layers keep
the model's own attention implementation, bound through a small module (``oscar_hf_attention``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn

from ..spec import LayerSpec
from . import hf_cache
from .sites import AttentionSite

NUM_LAYER_INPUTS = 16  # q, k, v, cu_seqlens, cache_lens, window_table, quant_table, 8 pools, write_cu


class HFAttentionCall(nn.Module):
    """Calls the model's configured attention implementation with the attributes it reads."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.num_key_value_groups = attention.num_key_value_groups
        self.is_causal = getattr(attention, "is_causal", True)
        self.head_dim = attention.head_dim

    def forward(self, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        impl = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        return impl(self, query, key, value, attention_mask, **kwargs)


def bind_model_attention(graph: torch.fx.Graph, site: AttentionSite) -> None:
    """Keep the model's attention: the marker node becomes a call of ``oscar_hf_attention``."""
    site.attention.op = "call_module"
    site.attention.target = "oscar_hf_attention"


def _getitems(graph: torch.fx.Graph, node: torch.fx.Node, count: int) -> list[torch.fx.Node]:
    items = []
    for i in range(count):
        with graph.inserting_after(items[-1] if items else node):
            items.append(graph.call_function(operator.getitem, (node, i)))
    return items


def _erase_with_getitems(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            for downstream in list(user.users):  # e.g. the attention weights in the output tuple
                downstream.args = torch.fx.node.map_arg(downstream.args, lambda n: None if n is user else n)
                downstream.kwargs = torch.fx.node.map_arg(downstream.kwargs, lambda n: None if n is user else n)
            graph.erase_node(user)
    graph.erase_node(node)


def swap_in_oscar_attention(graph: torch.fx.Graph, site: AttentionSite, layer: LayerSpec, scale: float) -> None:
    kv = layer.kv_cache
    window = (kv.sink_tokens, kv.recent_tokens)
    quant = (kv.bits, kv.group_size)
    with graph.inserting_before(site.attention):
        inputs = graph.call_function(
            hf_cache.layer_inputs,
            (site.cache, layer.index, site.query, site.key, site.value, *hf_cache.cache_geometry(layer)),
        )
    parts = _getitems(graph, inputs, NUM_LAYER_INPUTS)
    q, k, v, cu, lens, window_table, quant_table = parts[:7]
    pools, write_cu = parts[7:15], parts[15]
    with graph.inserting_after(parts[-1]):
        out = graph.call_function(
            torch.ops.oscar.attention.default,
            (q, k, v, cu, lens, window_table, quant_table, *pools, scale, *window, *quant),
        )
    with graph.inserting_after(out):
        write = graph.call_function(
            torch.ops.oscar.cache_write.default,
            (k, v, write_cu, lens, window_table, quant_table, *pools, *window, *quant,
             layer.key.clip_ratio, layer.value.clip_ratio),
        )
    with graph.inserting_after(write):
        full = graph.call_function(hf_cache.layer_outputs, (site.cache, layer.index, out, site.query))
    output = next(u for u in site.attention.users if u.target is operator.getitem and u.args[1] == 0)
    output.replace_all_uses_with(full)
    _erase_with_getitems(graph, site.attention)
    if site.cache_update is not None:
        _erase_with_getitems(graph, site.cache_update)
