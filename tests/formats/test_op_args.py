"""The op definitions (oscar_compile/formats/op_args.py) against the registered ``oscar::`` ops.

The definitions are the only place that knows each op's argument order: the registration derives
its schema from them, every implementation binds by name. So a registered schema that disagrees
with its definition (names, order, count, which arguments have defaults) must fail here, and so
must a kernel wrapper whose parameters no longer carry the names it is called with.
"""
import importlib
import inspect
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

import oscar_compile.kernels.ops  # noqa: F401  registers the oscar:: ops
from oscar_compile.formats.op_args import (
    OP_ARGS,
    AttentionArgs,
    CacheWriteArgs,
    RotateArgs,
    bind_node,
    node_args,
    op_of,
    op_schema,
)


def disagreements(definition: type, schema: torch.FunctionSchema) -> list[str]:
    """How a registered schema differs from a definition (empty: they agree)."""
    got = [(a.name, a.has_default_value()) for a in schema.arguments]
    want = [(name, name in definition._field_defaults) for name in definition._fields]
    out = []
    if len(got) != len(want):
        out.append(f"{len(got)} arguments registered, {len(want)} defined")
    # strict=False: a length mismatch is reported above; compare the arguments both sides have
    out += [f"argument {i}: registered {g}, defined {w}"
            for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
    return out


def _registered_oscar_ops() -> set[str]:
    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("oscar::")}


@pytest.mark.parametrize("name", sorted(OP_ARGS))
def test_registered_schema_matches_definition(name):
    definition = OP_ARGS[name]
    schema = getattr(torch.ops.oscar, name).default._schema
    assert disagreements(definition, schema) == []
    assert str(schema) == f"oscar::{name}{op_schema(definition)}"  # types and mutations too
    assert op_of(definition)._schema is schema


def test_every_oscar_op_has_a_definition():
    assert _registered_oscar_ops() == set(OP_ARGS)


class _SwappedScale(NamedTuple):  # oscar::attention_bf16 with its last two arguments swapped
    OP = "oscar::attention_bf16"
    q: Tensor
    k: Tensor
    v: Tensor
    cu_seqlens: Tensor
    cache_lens: Tensor
    page_table: Tensor
    k_pages: Tensor
    scale: float
    v_pages: Tensor


class _ExtraArgument(NamedTuple):  # oscar::rotate with one argument more
    OP = "oscar::rotate"
    x: Tensor
    rot: Tensor
    mean: Tensor | None = None
    extra: Tensor | None = None


def test_a_disagreeing_definition_is_caught():
    assert disagreements(_SwappedScale, torch.ops.oscar.attention_bf16.default._schema) != []
    assert disagreements(_ExtraArgument, torch.ops.oscar.rotate.default._schema) != []


# the functions each op implementation calls with ``**definition._asdict()`` (module, function, op)
KEYWORD_CALLEES = [
    ("attention.decode.attention_ref", "attention_ref", "attention"),
    ("attention.decode.attention_triton", "attention_triton", "attention"),
    ("attention.decode.attention_gluon", "attention_gluon", "attention"),
    ("attention.prefill.attention_extend_triton", "attention_extend_triton", "attention"),
    ("cache_write.cache_write_ref", "cache_write_ref", "cache_write"),  # without rot_k / mean_k: ops.py rotates first
    ("cache_write.cache_write_triton", "cache_write_triton", "cache_write"),
    ("attention.attention_bf16_ref", "attention_bf16_ref", "attention_bf16"),
    ("attention.attention_bf16_triton", "attention_bf16_triton", "attention_bf16"),
    ("attention.attention_bf16_ref", "cache_write_bf16_ref", "cache_write_bf16"),
    ("attention.attention_bf16_triton", "cache_write_bf16_triton", "cache_write_bf16"),
    ("elementwise.rotate_ref", "rotate_ref", "rotate"),
    ("elementwise.elementwise_ref", "rms_norm_ref", "rms_norm"),
    ("elementwise.elementwise_ref", "rope_ref", "rope"),
    ("elementwise.elementwise_ref", "silu_mul_ref", "silu_mul"),
    ("elementwise.elementwise_triton", "rms_norm_triton", "rms_norm"),
    ("elementwise.elementwise_triton", "rope_triton", "rope"),
    ("elementwise.elementwise_triton", "silu_mul_triton", "silu_mul"),
]


@pytest.mark.parametrize("module, function, op", KEYWORD_CALLEES)
def test_kernel_wrappers_take_the_defined_names(module, function, op):
    """Each wrapper / reference starts with the op's arguments, same names, same order."""
    fn = getattr(importlib.import_module(f"oscar_compile.kernels.{module}"), function)
    fields = list(OP_ARGS[op]._fields)
    if function == "cache_write_ref":
        fields = [f for f in fields if f not in ("rot_k", "mean_k")]
    assert list(inspect.signature(fn).parameters)[:len(fields)] == fields


def test_bind_node_and_node_args_round_trip():
    graph = torch.fx.Graph()
    x, rot, hist = (graph.placeholder(n) for n in ("x", "rot", "hist"))
    tensors = {name: graph.placeholder(name) for name in AttentionArgs._fields
               if name not in ("scale", "sink", "recent", "bits", "group_size", "history_lens")}
    bound = AttentionArgs(**tensors, scale=0.125, sink=4, recent=8, bits=2, group_size=32, history_lens=hist)
    args, kwargs = node_args(bound)
    assert kwargs == {"history_lens": hist} and len(args) == len(AttentionArgs._fields) - 1
    node = graph.call_function(op_of(AttentionArgs), args, kwargs)
    assert bind_node(AttentionArgs, node) == bound and bind_node(AttentionArgs, node).scale == 0.125
    rotate = graph.call_function(op_of(RotateArgs), *node_args(RotateArgs(x=x, rot=rot)))
    assert rotate.args == (x, rot) and rotate.kwargs == {} and bind_node(RotateArgs, rotate).mean is None


def test_op_call_binds_keywords_and_positions_alike():
    """The CPU implementation binds what the dispatcher passes: positions, keywords, or a mix."""
    torch.manual_seed(0)
    x, rot = torch.randn(1, 2, 3, 4), torch.linalg.qr(torch.randn(2, 4, 4))[0]
    mean = torch.randn(2, 4)
    want = torch.ops.oscar.rotate(*RotateArgs(x=x, rot=rot, mean=mean))
    assert torch.equal(torch.ops.oscar.rotate(x, rot=rot, mean=mean), want)
    assert torch.equal(torch.ops.oscar.rotate(**RotateArgs(x=x, rot=rot, mean=mean)._asdict()), want)
    assert CacheWriteArgs._fields[-1] == "history_lens"  # the documented trailing addition


def test_pool_names_are_the_cache_pools_fields():
    """``POOLS`` (formats cannot import the kernels) names the pools as ``CachePools`` does."""
    from oscar_compile.formats.op_args import POOLS
    from oscar_compile.kernels.pools import CachePools

    assert POOLS == CachePools._fields
    assert CacheWriteArgs._fields[6:14] == POOLS == AttentionArgs._fields[7:15]
