"""Rotate (and centre) keys and queries right after RoPE: k' = (k - mu) R_K, q' = q R_K.

R_K cannot be folded into W_K because RoPE sits between them. Since R_K is orthogonal,
q' . k' = q . k - q . mu, a shift shared by every key of a query: the softmax is unchanged, and
the cache stores keys in the basis the quantizer wants. Inserts ``oscar::rotate`` nodes.
"""
from __future__ import annotations

import torch
import torch.fx

from ..formats.op_args import RotateArgs, op_of
from .sites import AttentionSite


def _replace_uses_after(node: torch.fx.Node, new: torch.fx.Node) -> None:
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)


def insert_key_rotation(graph: torch.fx.Graph, site: AttentionSite, has_mean: bool) -> None:
    """Rotate site.query / site.key with the module buffers ``oscar_rot_k`` (and ``oscar_k_mean``)."""
    rotate = op_of(RotateArgs)
    with graph.inserting_after(site.key):
        rot = graph.get_attr("oscar_rot_k")
    with graph.inserting_after(rot):
        mean: torch.fx.Node | None = graph.get_attr("oscar_k_mean") if has_mean else None
    with graph.inserting_after(mean if mean is not None else rot):
        key = graph.call_function(rotate, tuple(RotateArgs(x=site.key, rot=rot, mean=mean)))
    with graph.inserting_after(key):
        query = graph.call_function(rotate, tuple(RotateArgs(x=site.query, rot=rot, mean=None)))
    _replace_uses_after(site.key, key)
    _replace_uses_after(site.query, query)
    site.key, site.query = key, query
