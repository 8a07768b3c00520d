"""The named arguments of every ``oscar::`` op: the one place that knows their order.

Each op has one ``NamedTuple`` here. Its fields are the op's arguments in schema order, the
trailing optional ones with their defaults; ``OP`` names the op, ``MUTATES`` the arguments it
writes in place, ``RETURNS`` its result type. ``kernels/ops.py`` registers each op with the schema
:func:`op_schema` derives from its definition, and tests/formats/test_op_args.py checks every
registered schema against it (names, order, count, defaults).

Everyone else binds arguments by name, so an added argument cannot shift another one:
- an op implementation receives what the dispatcher passes (positional, trailing defaults left
  out) and binds it with ``AttentionArgs(*args, **kwargs)``; it calls a kernel wrapper or a
  reference with ``**a._asdict()`` (their parameters carry the same names);
- a pass or the runtime reading an op node binds it with :func:`bind_node`
  (``bind_node(AttentionArgs, node).scale``);
- a pass building an op node passes :func:`node_args` of a definition built by keyword;
- a caller runs an op as ``torch.ops.oscar.attention(*AttentionArgs(q=q, ...))``, or edits one
  call's arguments with ``._replace(...)``.

Shapes and dtypes are those of docs/cache-format.md and kernels/ops.py. This module sits below the
kernels: it imports torch and nothing of oscar_compile.
"""
from __future__ import annotations

import inspect
import typing
from typing import Any, NamedTuple

import torch
from torch import Tensor

# the eight pools of an INT-b layer, in argument order (kernels/pools.py ``CachePools`` fields)
POOLS = ("k_win", "v_win", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


class RotateArgs(NamedTuple):
    """``oscar::rotate``: x [B, H, T, D], rot [H_r, D, D] f32, mean [H_r, D] f32 -> [B, H, T, D]."""

    OP = "oscar::rotate"
    MUTATES = ()
    RETURNS = Tensor
    x: Tensor
    rot: Tensor
    mean: Tensor | None = None


class CacheWriteArgs(NamedTuple):
    """``oscar::cache_write``: new tokens k, v [N, H_kv, D] into the pools of an INT-b layer."""

    OP = "oscar::cache_write"
    MUTATES = POOLS
    RETURNS = None
    k: Tensor
    v: Tensor
    cu_seqlens: Tensor
    cache_lens: Tensor
    window_table: Tensor
    quant_table: Tensor
    k_win: Tensor
    v_win: Tensor
    k_codes: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_zero: Tensor
    sink: int
    recent: int
    bits: int
    group_size: int
    clip_k: float
    clip_v: float
    rot_k: Tensor | None = None
    mean_k: Tensor | None = None
    history_lens: Tensor | None = None


class AttentionArgs(NamedTuple):
    """``oscar::attention``: new tokens q [N, H_q, D] attend to an INT-b layer's cache plus their
    own chunk k, v [N, H_kv, D], causally -> [N, H_q, D]."""

    OP = "oscar::attention"
    MUTATES = ()
    RETURNS = Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    cu_seqlens: Tensor
    cache_lens: Tensor
    window_table: Tensor
    quant_table: Tensor
    k_win: Tensor
    v_win: Tensor
    k_codes: Tensor
    k_scale: Tensor
    k_zero: Tensor
    v_codes: Tensor
    v_scale: Tensor
    v_zero: Tensor
    scale: float
    sink: int
    recent: int
    bits: int
    group_size: int
    history_lens: Tensor | None = None


class CacheWriteBf16Args(NamedTuple):
    """``oscar::cache_write_bf16``: new tokens k, v [N, H_kv, D] into full-precision pages
    [N_p, H_kv, P, D] through page_table [B, max_pages] int32."""

    OP = "oscar::cache_write_bf16"
    MUTATES = ("k_pages", "v_pages")
    RETURNS = None
    k: Tensor
    v: Tensor
    cu_seqlens: Tensor
    cache_lens: Tensor
    page_table: Tensor
    k_pages: Tensor
    v_pages: Tensor


class AttentionBf16Args(NamedTuple):
    """``oscar::attention_bf16``: new tokens attend to full-precision pages plus their own chunk
    -> [N, H_q, D]."""

    OP = "oscar::attention_bf16"
    MUTATES = ()
    RETURNS = Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    cu_seqlens: Tensor
    cache_lens: Tensor
    page_table: Tensor
    k_pages: Tensor
    v_pages: Tensor
    scale: float


class RmsNormArgs(NamedTuple):
    """``oscar::rms_norm``: RMSNorm of x over its last dimension."""

    OP = "oscar::rms_norm"
    MUTATES = ()
    RETURNS = Tensor
    x: Tensor
    weight: Tensor
    eps: float


class RopeArgs(NamedTuple):
    """``oscar::rope``: RoPE of q [B, H_q, T, D] and k [B, H_kv, T, D], then (with ``rot``) the
    rotation of both, keys centred by ``mean`` -> (q, k)."""

    OP = "oscar::rope"
    MUTATES = ()
    RETURNS = tuple[Tensor, Tensor]
    q: Tensor
    k: Tensor
    cos: Tensor
    sin: Tensor
    rot: Tensor | None = None
    mean: Tensor | None = None


class SiluMulArgs(NamedTuple):
    """``oscar::silu_mul``: the gated MLP's ``silu(gate) * up``."""

    OP = "oscar::silu_mul"
    MUTATES = ()
    RETURNS = Tensor
    gate: Tensor
    up: Tensor


# every oscar:: op, by its name in the oscar namespace
OP_ARGS: dict[str, type] = {cls.OP.split("::")[1]: cls for cls in (
    RotateArgs, CacheWriteArgs, AttentionArgs, CacheWriteBf16Args, AttentionBf16Args, RmsNormArgs, RopeArgs,
    SiluMulArgs)}


def op_schema(definition: type) -> str:
    """The schema string of an op, inferred by ``torch.library`` from its definition (as it would
    infer it from a function with these parameters), e.g. ``(Tensor x, Tensor rot, Tensor? mean=None) -> Tensor``."""
    hints = typing.get_type_hints(definition)
    empty = inspect.Parameter.empty
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=hints[name],
                                default=definition._field_defaults.get(name, empty))
              for name in definition._fields]

    def prototype(*args, **kwargs):  # pragma: no cover - only its signature is read
        raise NotImplementedError

    prototype.__signature__ = inspect.Signature(params, return_annotation=definition.RETURNS)
    return torch.library.infer_schema(prototype, mutates_args=definition.MUTATES)


def op_of(definition: type) -> torch._ops.OpOverload:
    """The registered overload of the op of ``definition`` (kernels/ops.py must be imported)."""
    return getattr(torch.ops.oscar, definition.OP.split("::")[1]).default


def bind_node(definition: type, node: torch.fx.Node) -> NamedTuple:
    """The arguments of an FX node calling the op of ``definition``, by name (graph nodes, values)."""
    return definition(*node.args, **node.kwargs)


def node_args(bound: NamedTuple) -> tuple[tuple, dict[str, Any]]:
    """(args, kwargs) for an FX node calling ``bound``'s op: the required arguments in order, the
    optional ones by keyword, and only when not left at their default (the node a hand-written
    call would make)."""
    defaults = type(bound)._field_defaults
    args = tuple(getattr(bound, name) for name in bound._fields if name not in defaults)
    kwargs = {name: getattr(bound, name) for name in bound._fields
              if name in defaults and getattr(bound, name) is not defaults[name]}
    return args, kwargs


__all__ = ["OP_ARGS", "POOLS", "AttentionArgs", "AttentionBf16Args", "CacheWriteArgs", "CacheWriteBf16Args",
           "RmsNormArgs", "RopeArgs", "RotateArgs", "SiluMulArgs", "bind_node", "node_args", "op_of", "op_schema"]
