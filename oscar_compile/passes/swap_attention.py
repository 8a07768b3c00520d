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
from ..formats.cache import LayerFormat
from ..formats.op_args import AttentionArgs, AttentionBf16Args, CacheWriteArgs, CacheWriteBf16Args, node_args, op_of
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


def _op_calls(layer: LayerSpec, cache: LayerFormat, scale: float) -> tuple:
    """(attention op's definition, its constants, write op's definition, its constants) of a layer."""
    if cache.full_precision_pages:
        return AttentionBf16Args, dict(scale=scale), CacheWriteBf16Args, {}
    window = dict(sink=cache.sink, recent=cache.recent, bits=cache.bits, group_size=cache.group_size)
    return (AttentionArgs, dict(scale=scale, **window),
            CacheWriteArgs, dict(window, clip_k=layer.key.clip_ratio, clip_v=layer.value.clip_ratio))


def _call(graph: torch.fx.Graph, definition: type, inputs: dict, **constants) -> torch.fx.Node:
    """A node calling the op of ``definition``: its tensors from ``inputs`` by name, then ``constants``."""
    tensors = {name: node for name, node in inputs.items() if name in definition._fields}
    args, kwargs = node_args(definition(**tensors, **constants))
    return graph.call_function(op_of(definition), args, kwargs)


def swap_in_oscar_attention(graph: torch.fx.Graph, site: AttentionSite, layer: LayerSpec, scale: float) -> str:
    """Replace cache update + attention by the paged oscar ops; returns the attention op's name."""
    cache = LayerFormat.of(layer)
    attention_op, attention_consts, write_op, write_consts = _op_calls(layer, cache, scale)
    with graph.inserting_before(site.attention):
        inputs = graph.call_function(nodes.layer_inputs,
                                     (site.cache, layer.index, site.query, site.key, site.value), cache.as_kwargs())
    names = contract.layer_input_names(cache)
    items = _getitems(graph, inputs, len(names))
    part = dict(zip(names, items, strict=True))
    with graph.inserting_after(items[-1]):
        out = _call(graph, attention_op, part, **attention_consts)
    with graph.inserting_after(out):  # the write's cu_seqlens: write_cu (all zeros when nothing is kept)
        write = _call(graph, write_op, {**part, "cu_seqlens": part["write_cu"]}, **write_consts)
    with graph.inserting_after(write):
        full = graph.call_function(nodes.layer_outputs, (site.cache, layer.index, out, site.query))
    output = next(u for u in site.attention.users if u.target is operator.getitem and u.args[1] == 0)
    output.replace_all_uses_with(full)
    _erase_with_getitems(graph, site.attention)
    if site.cache_update is not None:
        _erase_with_getitems(graph, site.cache_update)
    return attention_op.OP
