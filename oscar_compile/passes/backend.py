"""``torch.compile(model, backend=oscar_compile.backend(spec, rotations))``: the rewrite on dynamo graphs.

Dynamo hands the backend the FX graph of the *original* model, with parameters as graph inputs,
so R_V cannot be folded into weights here; the same linear map is applied in the graph instead:
v' = v R_V before attention and out R_V^T after it (equal to the fold by orthogonality). Keys
and queries get ``oscar::rotate`` as in eager ``apply``, and on quantized layers SDPA becomes
``oscar::attention`` over the chunk (the compiled forward holds no cache: it is the prefill /
scoring path; decoding with the INT2 cache goes through ``apply``). Padding masks are not
applied on quantized layers (causal attention over the whole chunk). The layer of each SDPA call
is read from the module stack dynamo records on the node.
"""
from __future__ import annotations

import logging
import operator
import re
from collections.abc import Callable

import torch
import torch.fx

from ..artifact import Rotations
from ..cache import contract, nodes
from ..formats.cache import LayerFormat
from ..formats.op_args import AttentionArgs, RotateArgs, node_args, op_of
from ..spec import CompressionSpec

logger = logging.getLogger(__name__)
_SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_LAYER = re.compile(r"layers[._](\d+)[._]")


def _layer_of(node: torch.fx.Node) -> int | None:
    for path, _ in reversed(list((node.meta.get("nn_module_stack") or {}).values())):
        match = _LAYER.search(str(path) + ".")
        if match:
            return int(match.group(1))
    return None


class OscarBackend:
    """A dynamo backend; ``graphs`` keeps every rewritten GraphModule for inspection."""

    def __init__(self, spec: CompressionSpec, rotations: Rotations, inner: Callable | None = None):
        self.spec, self.rotations, self.inner = spec, rotations, inner
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        num_layers = self.rotations.num_layers
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and node.target in _SDPA_TARGETS:
                layer = _layer_of(node)
                if layer is None:
                    raise NotImplementedError(f"cannot tell which layer SDPA node {node.name} belongs to")
                spec = self.spec.for_layer(layer, num_layers)
                if not spec.overridden_to_16_bits:
                    self._rewrite_sdpa(gm, node, spec)
        gm.graph.lint()
        gm.recompile()
        self.graphs.append(gm)
        return gm.forward if self.inner is None else self.inner(gm, example_inputs)

    def _buffer(self, gm: torch.fx.GraphModule, name: str, value: torch.Tensor) -> torch.fx.Node:
        gm.register_buffer(name, value.float().contiguous(), persistent=False)
        return gm.graph.get_attr(name)

    def _rewrite_sdpa(self, gm: torch.fx.GraphModule, sdpa: torch.fx.Node, layer) -> None:
        i, g = layer.index, gm.graph
        q, k, v = sdpa.args[:3]
        scale = sdpa.kwargs.get("scale") or self.rotations.fingerprint.head_dim ** -0.5
        rot = self.rotations
        mean = rot.k_mean[i] if layer.key.center else None
        if layer.key.center and mean is None:
            raise ValueError(f"layer {i}: key.center is on but the rotations have no key means")
        with g.inserting_before(sdpa):
            rk = self._buffer(gm, f"oscar_rot_k_{i}", rot.k[i])
            rv = self._buffer(gm, f"oscar_rot_v_{i}", rot.v[i])
            rv_t = self._buffer(gm, f"oscar_rot_v_t_{i}", rot.v[i].transpose(1, 2))
            mu = self._buffer(gm, f"oscar_k_mean_{i}", mean) if mean is not None else None
            rotate = op_of(RotateArgs)
            q2 = g.call_function(rotate, tuple(RotateArgs(x=q, rot=rk, mean=None)))
            k2 = g.call_function(rotate, tuple(RotateArgs(x=k, rot=rk, mean=mu)))
            v2 = g.call_function(rotate, tuple(RotateArgs(x=v, rot=rv, mean=None)))
            if layer.quantized:
                out = self._oscar_attention(g, layer, q2, k2, v2, float(scale))
            else:
                out = g.call_function(sdpa.target, (q2, k2, v2, *sdpa.args[3:]), dict(sdpa.kwargs))
            back = g.call_function(rotate, tuple(RotateArgs(x=out, rot=rv_t, mean=None)))
        sdpa.replace_all_uses_with(back)
        g.erase_node(sdpa)

    def _oscar_attention(self, g: torch.fx.Graph, layer, q, k, v, scale: float) -> torch.fx.Node:
        kv = layer.kv_cache
        inputs = g.call_function(nodes.layer_inputs, (None, layer.index, q, k, v), LayerFormat.of(layer).as_kwargs())
        names = (*contract.QKV_INPUTS, *contract.WINDOWED_CACHE_INPUTS)  # the items up to write_cu
        parts = {name: g.call_function(operator.getitem, (inputs, j)) for j, name in enumerate(names)}
        args, kwargs = node_args(AttentionArgs(**parts, scale=scale, sink=kv.sink_tokens, recent=kv.recent_tokens,
                                               bits=kv.bits, group_size=kv.group_size))
        out = g.call_function(op_of(AttentionArgs), args, kwargs)
        full = g.call_function(nodes.layer_outputs, (None, layer.index, out, q))  # [B, T, H, D]
        return g.call_method("transpose", (full, 1, 2))  # SDPA's layout [B, H, T, D]


def backend(spec: CompressionSpec, rotations: Rotations, inner: Callable | None = None) -> OscarBackend:
    """A ``torch.compile`` backend applying the oscar rewrite; ``inner`` compiles the result (default: run eagerly)."""
    return OscarBackend(spec, rotations, inner)
