"""Find the pieces of attention in a traced graph: RoPE, the cache update, the attention call.

Each ``_detect_*`` helper returns a node or None; :func:`find_attention_site` puts them together
and says which piece is missing when a graph does not have the expected shape.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch.fx

from .trace import attention_site


@dataclass
class AttentionSite:
    rope: torch.fx.Node  # apply_rotary_pos_emb(q, k, cos, sin)
    query: torch.fx.Node  # getitem(rope, 0): post-RoPE queries [B, H_q, T, D]
    key: torch.fx.Node  # getitem(rope, 1): post-RoPE keys [B, H_kv, T, D]
    value: torch.fx.Node  # values entering the cache [B, H_kv, T, D]
    cache: torch.fx.Node  # the cache placeholder
    cache_update: torch.fx.Node | None  # cache.update(k, v, layer_idx, ...)
    attention: torch.fx.Node  # attention_site(q, k, v, mask, ...)


def _getitem_of(node: torch.fx.Node, index: int) -> torch.fx.Node | None:
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] == index:
            return user
    return None


def _detect_rope(graph: torch.fx.Graph) -> torch.fx.Node | None:
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "apply_rotary_pos_emb":
            return node
    return None


def _detect_attention(graph: torch.fx.Graph) -> torch.fx.Node | None:
    for node in graph.nodes:
        if node.op == "call_function" and node.target is attention_site:
            return node
    return None


def _detect_cache_update(graph: torch.fx.Graph, cache: torch.fx.Node) -> torch.fx.Node | None:
    for node in cache.users:
        if node.op == "call_method" and node.target == "update" and node.args[0] is cache:
            return node
    return None


def find_attention_site(graph: torch.fx.Graph) -> AttentionSite:
    placeholders = {n.target: n for n in graph.nodes if n.op == "placeholder"}
    rope = _detect_rope(graph)
    attention = _detect_attention(graph)
    if rope is None or attention is None:
        missing = "apply_rotary_pos_emb" if rope is None else "the attention call"
        raise NotImplementedError(f"attention graph has an unexpected shape: {missing} not found")
    query, key = _getitem_of(rope, 0), _getitem_of(rope, 1)
    cache = placeholders["cache"]
    update = _detect_cache_update(graph, cache)
    if update is not None:
        value = update.args[2] if len(update.args) > 2 else update.kwargs["value_states"]
    else:
        value = attention.args[2]
    return AttentionSite(rope, query, key, value, cache, update, attention)
