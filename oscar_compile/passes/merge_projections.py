"""One GEMM for q/k/v and one for gate/up: same weights, fewer and larger matrix products.

Why: at batch 1 each projection is a matrix-vector product that reads its weight once; a 1024-row
k or v projection is too small to reach full bandwidth, and each one is a launch. Concatenating
the weights (q | k | v, gate | up) turns five products per layer into two, with outputs that are
column slices of one product: equal to the separate products (each output element is the same
dot product of the same row).

Memory stays the same: the original ``nn.Linear`` weights become views into the concatenated
tensor, so ``state_dict()`` and parameter counts do not change. Moving the model to another
device afterwards would copy the views apart (twice the memory, same values): apply first moves.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

QKV = ("q_proj", "k_proj", "v_proj")


def concat_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of the stacked outputs, re-pointing each Linear to its slice; None when they
    cannot share one product (different inputs, dtypes or devices, or bias on some only)."""
    first = linears[0]
    if any(type(lin) is not nn.Linear or not lin.weight.is_floating_point()  # not e.g. a quantized Linear subclass
           or (lin.in_features, lin.weight.dtype, lin.weight.device) != (first.in_features, first.weight.dtype,
                                                                         first.weight.device)
           for lin in linears):
        return None
    biased = [lin.bias is not None for lin in linears]
    if any(biased) != all(biased):
        return None
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = torch.cat([lin.bias for lin in linears]) if all(biased) else None
    offset = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = nn.Parameter(weight[offset:offset + n], requires_grad=lin.weight.requires_grad)
        if bias is not None:
            lin.bias = nn.Parameter(bias[offset:offset + n], requires_grad=lin.bias.requires_grad)
        offset += n
    return weight, bias


def merge_qkv(owners: list[nn.Module], graph: torch.fx.Graph) -> bool:
    """Replace ``q_proj(x), k_proj(x), v_proj(x)`` in a traced attention graph by one ``F.linear`` on
    the buffers ``oscar_qkv_weight`` / ``oscar_qkv_bias`` (registered on each of ``owners``) and
    three ``narrow`` views; False, graph untouched, when the graph does not project one input."""
    module = owners[0]
    nodes = {n.target: n for n in graph.nodes if n.op == "call_module" and n.target in QKV}
    if len(nodes) != 3 or any(len(n.args) != 1 or n.kwargs for n in nodes.values()):
        return False
    inputs = {n.args[0] for n in nodes.values()}
    linears = [getattr(module, name) for name in QKV]
    if len(inputs) != 1:
        return False
    merged = concat_linears(linears)
    if merged is None:
        return False
    weight, bias = merged
    for owner in owners:
        owner.register_buffer("oscar_qkv_weight", weight, persistent=False)
        owner.register_buffer("oscar_qkv_bias", bias, persistent=False)
    first = min(nodes.values(), key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(first):
        w = graph.get_attr("oscar_qkv_weight")
        b = graph.get_attr("oscar_qkv_bias") if bias is not None else None
        qkv = graph.call_function(F.linear, (inputs.pop(), w, b))
    offset = 0
    for name, linear in zip(QKV, linears, strict=True):
        with graph.inserting_after(qkv):
            part = graph.call_function(torch.narrow, (qkv, -1, offset, linear.out_features))
        nodes[name].replace_all_uses_with(part)
        graph.erase_node(nodes[name])
        offset += linear.out_features
    return True


def merge_gate_up(mlp: nn.Module) -> bool:
    """Give ``mlp`` the buffer ``oscar_gate_up_weight`` ([gate | up] rows, no bias); False if not possible."""
    linears = [mlp.gate_proj, mlp.up_proj]
    if any(lin.bias is not None for lin in linears) or linears[0].out_features != linears[1].out_features:
        return False
    merged = concat_linears(linears)
    if merged is None:
        return False
    mlp.register_buffer("oscar_gate_up_weight", merged[0], persistent=False)
    return True
