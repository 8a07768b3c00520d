"""Replace the cache update + attention call of a traced layer.

Layers with windows: the model's attention becomes ``oscar::attention`` over the windows + history
cache followed by ``oscar::cache_write`` of the new tokens (attention first: the chunk attends to
its own keys in full precision, as serving engines prefill); the history is INT-b, or 16-bit rows
for a layer kept at 16 bits beside INT-b layers (bits = 16, the same page tables). 16-bit layers
without windows (a model with nothing quantized) get the full-precision paged pair
(``oscar::attention_bf16`` / ``oscar::cache_write_bf16``). So the paged runtime serves every layer.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..cache import contract, nodes
from ..cache.layout import LayerCache
from ..spec import LayerSpec
from .sites import AttentionSite


def _getitems(graph: torch.fx.Graph, node: torch.fx.Node, count: int) -> list[torch.fx.Node]:
    items = []
    for i in range(count):
        with graph.inserting_after(items[-1] if items else node):
            items.append(graph.call_function(operator.getitem, (node, i)))
    return items


def _erase_with_getitems(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            def drop(n, user=user):  # the getitem about to be erased -> None
                return None if n is user else n

            for downstream in list(user.users):  # e.g. the attention weights in the output tuple
                downstream.args = torch.fx.node.map_arg(downstream.args, drop)
                downstream.kwargs = torch.fx.node.map_arg(downstream.kwargs, drop)
            graph.erase_node(user)
    graph.erase_node(node)


def _op_calls(layer: LayerSpec, cache: LayerCache, scale: float) -> tuple:
    """(attention op, its trailing constants, write op, its constants) of a layer."""
    if cache.full_precision_pages:
        return torch.ops.oscar.attention_bf16.default, (scale,), torch.ops.oscar.cache_write_bf16.default, ()
    window, quant = (cache.sink, cache.recent), (cache.bits, cache.group_size)
    return (torch.ops.oscar.attention.default, (scale, *window, *quant),
            torch.ops.oscar.cache_write.default, (*window, *quant, layer.key.clip_ratio, layer.value.clip_ratio))


def swap_in_oscar_attention(graph: torch.fx.Graph, site: AttentionSite, layer: LayerSpec, scale: float) -> str:
    """Replace cache update + attention by the paged oscar ops; returns the attention op's name."""
    cache = LayerCache.of(layer)
    attention_op, attention_consts, write_op, write_consts = _op_calls(layer, cache, scale)
    with graph.inserting_before(site.attention):
        inputs = graph.call_function(nodes.layer_inputs,
                                     (site.cache, layer.index, site.query, site.key, site.value), cache.as_kwargs())
    names = contract.layer_input_names(cache)
    items = _getitems(graph, inputs, len(names))
    part = dict(zip(names, items, strict=True))
    q, k, v, cu = (part[n] for n in contract.QKV_INPUTS)
    cache_args = [part[n] for n in contract.cache_input_names(cache)]
    write_cu = part["write_cu"]
    extra = {"history_lens": part["history_lens"]} if "history_lens" in part else {}
    with graph.inserting_after(items[-1]):
        out = graph.call_function(attention_op, (q, k, v, cu, *cache_args, *attention_consts), extra)
    with graph.inserting_after(out):
        write = graph.call_function(write_op, (k, v, write_cu, *cache_args, *write_consts), extra)
    with graph.inserting_after(write):
        full = graph.call_function(nodes.layer_outputs, (site.cache, layer.index, out, site.query))
    output = next(u for u in site.attention.users if u.target is operator.getitem and u.args[1] == 0)
    output.replace_all_uses_with(full)
    _erase_with_getitems(graph, site.attention)
    if site.cache_update is not None:
        _erase_with_getitems(graph, site.cache_update)
    return f"oscar::{attention_op._schema.name.split('::')[1]}"
