"""The calls a rewritten layer's graph makes between its two cache nodes, as a callable of their inputs.

A piecewise CUDA graph of a step (``runtime/worker/piecewise_graphs.py``) captures everything but
attention: between the replayed pieces it asks the step's cache for a layer's op inputs, runs
what the layer's graph runs on them (the ``oscar::`` attention and cache-write calls, with the
constants they carry) and hands the output back. Copied node for node out of the graph, the calls
stay the graph's own: no second place spells their arguments. The copies call the attention and
cache-write ops' implementations directly (``kernels.ops.direct``), without the custom-op
wrappers' host time.
"""
from __future__ import annotations

import inspect

from torch import fx, nn

from ..kernels import ops
from . import nodes


def graph_attention_core(graph: fx.Graph) -> tuple[int, fx.GraphModule] | None:
    """(layer index, the core: ``core(inputs) -> output [N, H_q, D]``, ``inputs`` being what
    ``layer_inputs`` returned) of one rewritten layer's graph. None when the calls between the two
    nodes read anything else (a module attribute, a tensor computed before them): then they are
    not the attention alone, and a piecewise graph cannot leave them out of its pieces."""
    order = list(graph.nodes)
    firsts = [n for n in order if n.op == "call_function" and n.target is nodes.layer_inputs]
    lasts = [n for n in order if n.op == "call_function" and n.target is nodes.layer_outputs]
    if len(firsts) != 1 or len(lasts) != 1:
        return None
    first, last = firsts[0], lasts[0]
    core = fx.Graph()
    env = {first: core.placeholder("inputs")}
    for node in order[order.index(first) + 1:order.index(last)]:
        if node.op != "call_function" or any(arg not in env for arg in node.all_input_nodes):
            return None
        env[node] = copied = core.node_copy(node, env.__getitem__)
        copied.target = ops.direct(node.target)  # the same implementation, without the dispatcher
    out = _bound(nodes.layer_outputs, last)["out"]
    if not isinstance(out, fx.Node) or out not in env:
        return None
    core.output(env[out])
    core.lint()
    return int(_bound(nodes.layer_inputs, first)["layer_idx"]), fx.GraphModule(nn.Module(), core)


def _bound(fn, node: fx.Node) -> dict:
    """A cache node's arguments by the names of its function."""
    return inspect.signature(fn).bind(*node.args, **node.kwargs).arguments


__all__ = ["graph_attention_core"]
