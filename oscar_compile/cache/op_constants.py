"""The constants a rewritten layer passes its INT-b ops, read back from its graph.

Code that runs a layer's ops itself, beside the graph (the runtime's staged rows, decode-consistent
prefill), must pass the same attention scale and clip ratios as the graph's own op calls, so it
reads them from those calls instead of recomputing them. ``apply`` reads them once, from each
graph it rewrites, into the handle it returns (passes/compressed_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.cache import LayerFormat
from ..formats.op_args import AttentionArgs, CacheWriteArgs, bind_node
from . import nodes


@dataclass(frozen=True)
class OpConstants:
    """What a layer's graph passes its INT-b ops besides tensors: the layer's cache (the keyword
    constants of its ``layer_inputs`` node), the attention scale and the write's clip ratios."""

    layer: LayerFormat
    scale: float
    clip_k: float
    clip_v: float


def graph_op_constants(graph: torch.fx.Graph) -> tuple[int, OpConstants] | None:
    """(layer index, the constants of its INT-b op calls) of one rewritten layer's graph; None for
    a graph without them (a layer of ``oscar::attention_bf16`` over full-precision pages)."""
    index = layer = scale = clips = None
    for node in graph.nodes:
        if node.target is nodes.layer_inputs:
            index, layer = node.args[1], LayerFormat(**node.kwargs)
        elif node.target is torch.ops.oscar.attention.default:
            scale = float(bind_node(AttentionArgs, node).scale)
        elif node.target is torch.ops.oscar.cache_write.default:
            write = bind_node(CacheWriteArgs, node)
            clips = (float(write.clip_k), float(write.clip_v))
    if index is None or scale is None or clips is None:
        return None
    return index, OpConstants(layer, scale, *clips)
