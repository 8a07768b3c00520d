"""The ``oscar::`` custom ops: one registration per kernel, plain-torch reference everywhere, Triton on CUDA.

Signatures follow docs/cache-format.md; each op's arguments are named, in order, by its definition
in ``oscar_compile/formats/op_args.py`` (the schema is derived from it, and every implementation
binds its arguments by name). Each op is a ``torch.library.custom_op`` with a fake
(meta) implementation so ``torch.compile(fullgraph=True)`` traces through it. The default
implementation (CPU and any device without a kernel) is the ``*_ref`` module; on CUDA the Triton
wrapper runs when Triton is importable, else the reference. ``oscar::attention`` on sm_90 runs
the Gluon kernel for decode-like INT2 batches, and on any GPU prefill-like INT-b calls take the
extend path (history dequantized once, then the paged BF16 kernel; ``attention_dispatch``: the
active ``AttentionDispatch``, whose setting ``OSCAR_ATTENTION_KERNEL`` is read once).

Importing this module is cheap: Triton modules are imported inside the CUDA implementations, on
first call, never here (no CUDA initialisation, no compilation at import).

Additions to the documented signatures (trailing, with defaults, so documented calls still work):
- ``oscar::rotate``: ``mean`` defaults to None.
- ``oscar::cache_write``: ``rot_k: Tensor? = None, mean_k: Tensor? = None``. When ``rot_k`` is
  given, k arrives *unrotated* (post-RoPE) and the op applies ``oscar::rotate(k, rot_k, mean_k)``
  first (fused into the write kernel on CUDA): one launch per layer instead of two.
- ``oscar::cache_write`` and ``oscar::attention``: ``history_lens: Tensor? = None`` (last), [B]
  int32, the history length h of each sequence before the call. The ring then holds positions
  ``[S0 + h, L)``; None means the standard ``h = max(0, L - W - S0)`` (a full ring once L >= S0 + W).
  The runtime passes it after prefix-cache hits past the sink (shared history, ring refilling);
  docs/cache-format.md gives the general ring state and what each op does with it.

Ops beyond docs/cache-format.md, for the full-precision paged cache (runtime BF16 mode, baseline):
- ``oscar::cache_write_bf16(k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages) -> ()``
- ``oscar::attention_bf16(q, k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages, scale)
  -> [N, H_q, D]``; pages ``[N_p, H_kv, P, D]``, page_table ``[B, max_pages]`` int32.

Fused per-layer ops (passes/fuse_elementwise.py swaps them in; references in elementwise_ref.py):
``oscar::rms_norm(x, weight, eps)``, ``oscar::rope(q, k, cos, sin, rot=None, mean=None) -> (q, k)``,
``oscar::silu_mul(gate, up)``.
"""
from __future__ import annotations

import functools
import importlib.util

import torch
from torch import Tensor

from oscar_compile.formats.op_args import (
    AttentionArgs,
    AttentionBf16Args,
    CacheWriteArgs,
    CacheWriteBf16Args,
    RmsNormArgs,
    RopeArgs,
    RotateArgs,
    SiluMulArgs,
    op_schema,
)
from oscar_compile.kernels.attention.attention_bf16_ref import attention_bf16_ref, cache_write_bf16_ref
from oscar_compile.kernels.attention.decode.attention_ref import attention_ref
from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref
from oscar_compile.kernels.elementwise.elementwise_ref import rms_norm_ref, rope_ref, silu_mul_ref
from oscar_compile.kernels.elementwise.rotate_ref import rotate_ref
from oscar_compile.kernels.pools import CachePools, allocate_pools  # noqa: F401  (re-export)


def _register(definition: type):
    """``torch.library.custom_op`` for the op of ``definition`` (oscar_compile/formats/op_args.py),
    with the schema derived from it: the implementations below take ``*args, **kwargs`` and bind
    them by name, ``definition(*args, **kwargs)``."""
    return torch.library.custom_op(definition.OP, mutates_args=definition.MUTATES, schema=op_schema(definition))


@functools.cache
def triton_available() -> bool:
    """True when Triton can be imported (checked once, without importing it here)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_impl(module: str, name: str):
    """The Triton wrapper ``oscar_compile.kernels.<module>.<name>``, or None without Triton / module."""
    full = f"oscar_compile.kernels.{module}"
    if not triton_available() or importlib.util.find_spec(full) is None:
        return None
    return getattr(importlib.import_module(full), name)


def _triton_on_cuda(op, definition: type, module: str, name: str, ref):
    """On CUDA, ``op`` runs the Triton wrapper ``oscar_compile.kernels.<module>.<name>`` (imported
    at its first call), or ``ref`` without Triton; both take the op's arguments by name. Returns
    the CUDA implementation."""

    def on_cuda(*args, **kwargs):
        fields = definition(*args, **kwargs)._asdict()
        impl = _triton_impl(module, name)
        return impl(**fields) if impl is not None else ref(**fields)

    op.register_kernel("cuda")(on_cuda)
    return on_cuda


def _rotate_tokens_ref(k: Tensor, rot: Tensor, mean: Tensor | None) -> Tensor:
    # k: [N, H_kv, D] -> rotate sees [1, H_kv, N, D]
    return rotate_ref(k.transpose(0, 1).unsqueeze(0), rot, mean).squeeze(0).transpose(0, 1)


# ---------------------------------------------------------------- oscar::rotate
@_register(RotateArgs)
def rotate(*args, **kwargs) -> Tensor:
    """(x - mean[h // g]) @ rot[h // g]; x: [B, H, T, D], rot: [H_r, D, D] f32, mean: [H_r, D] f32.

    One batched float32 matmul on every device, no Triton kernel: with ``apply(fuse=True)`` (the
    default) the key and query rotation runs inside ``oscar::rope`` instead."""
    return rotate_ref(**RotateArgs(*args, **kwargs)._asdict())


@rotate.register_fake
def _(*args, **kwargs):
    return torch.empty_like(RotateArgs(*args, **kwargs).x)


# ---------------------------------------------------------------- oscar::cache_write
def _cache_write_ref(a: CacheWriteArgs) -> None:
    """The reference write; with ``rot_k``, k is rotated first (the reference takes rotated keys)."""
    if a.rot_k is not None:
        a = a._replace(k=_rotate_tokens_ref(a.k, a.rot_k, a.mean_k))
    fields = a._asdict()
    del fields["rot_k"], fields["mean_k"]
    cache_write_ref(**fields)


def _cache_write_default(*args, **kwargs) -> None:
    """Write new tokens k, v: [N, H_kv, D] into the pools (see cache_write_ref for the rules)."""
    _cache_write_ref(CacheWriteArgs(*args, **kwargs))


cache_write = _register(CacheWriteArgs)(_cache_write_default)


@cache_write.register_fake
def _(*args, **kwargs):
    return None


def _cache_write_cuda(*args, **kwargs):
    a = CacheWriteArgs(*args, **kwargs)
    impl = _triton_impl("cache_write.cache_write_triton", "cache_write_triton")
    head_dim = a.k.shape[-1]
    if impl is not None and not head_dim & (head_dim - 1):  # the kernel tiles D: a power of two
        return impl(**a._asdict())
    # other head dims (80, 96, ...) take the reference, as oscar::attention does (attention_triton)
    _cache_write_ref(a)


cache_write.register_kernel("cuda")(_cache_write_cuda)


# ---------------------------------------------------------------- oscar::attention
def _attention_default(*args, **kwargs) -> Tensor:
    """New tokens q: [N, H_q, D] attend to the cache plus their own chunk, causally -> [N, H_q, D]."""
    return attention_ref(**AttentionArgs(*args, **kwargs)._asdict())


attention = _register(AttentionArgs)(_attention_default)


@attention.register_fake
def _(*args, **kwargs):
    return torch.empty_like(AttentionArgs(*args, **kwargs).q)


def _attention_cuda(*args, **kwargs):  # as the dispatcher passes them (history_lens only when given)
    a = AttentionArgs(*args, **kwargs)
    # the Gluon Hopper kernel or the Triton one: kernels/attention/attention_dispatch.py chooses
    impl = _triton_impl("attention.attention_dispatch", "attention_cuda")
    if impl is not None:
        return impl(a)
    return attention_ref(**a._asdict())


attention.register_kernel("cuda")(_attention_cuda)


# ---------------------------------------------------------------- full-precision paged cache
def _cache_write_bf16_default(*args, **kwargs) -> None:
    """Scatter new tokens into full-precision pages (one Triton launch on CUDA)."""
    cache_write_bf16_ref(**CacheWriteBf16Args(*args, **kwargs)._asdict())


cache_write_bf16 = _register(CacheWriteBf16Args)(_cache_write_bf16_default)


@cache_write_bf16.register_fake
def _(*args, **kwargs):
    return None


_cache_write_bf16_cuda = _triton_on_cuda(cache_write_bf16, CacheWriteBf16Args, "attention.attention_bf16_triton",
                                         "cache_write_bf16_triton", cache_write_bf16_ref)


def _attention_bf16_default(*args, **kwargs) -> Tensor:
    """New tokens attend to full-precision pages plus their own chunk, causally -> [N, H_q, D]."""
    return attention_bf16_ref(**AttentionBf16Args(*args, **kwargs)._asdict())


attention_bf16 = _register(AttentionBf16Args)(_attention_bf16_default)


@attention_bf16.register_fake
def _(*args, **kwargs):
    return torch.empty_like(AttentionBf16Args(*args, **kwargs).q)


_attention_bf16_cuda = _triton_on_cuda(attention_bf16, AttentionBf16Args, "attention.attention_bf16_triton",
                                       "attention_bf16_triton", attention_bf16_ref)


# ---------------------------------------------------------------- the cache ops, called directly
def _on_device(op: torch._ops.OpOverload, cuda, default):
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():  # a traced call keeps the op (its fake, the graph's node)
            return op(*args, **kwargs)
        device_of = next(iter((*args, *kwargs.values())))  # q or k: the first argument of all four
        return cuda(*args, **kwargs) if device_of.is_cuda else default(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"direct_{op._schema.name.split('::')[-1]}"
    return call


_DIRECT = {
    torch.ops.oscar.attention.default: _on_device(torch.ops.oscar.attention.default, _attention_cuda,
                                                  _attention_default),
    torch.ops.oscar.cache_write.default: _on_device(torch.ops.oscar.cache_write.default, _cache_write_cuda,
                                                    _cache_write_default),
    torch.ops.oscar.attention_bf16.default: _on_device(torch.ops.oscar.attention_bf16.default, _attention_bf16_cuda,
                                                       _attention_bf16_default),
    torch.ops.oscar.cache_write_bf16.default: _on_device(torch.ops.oscar.cache_write_bf16.default,
                                                         _cache_write_bf16_cuda, _cache_write_bf16_default),
}


def direct(op: torch._ops.OpOverload):
    """The attention / cache-write op ``op``'s implementation for its arguments' device, called
    without the dispatcher (the op itself for any other op). Eager code between CUDA graphs runs
    these ops once per layer and step, and a ``custom_op`` call costs Python of its own before its
    implementation runs (its autograd, in-place and alias-check wrappers): on an H100 host, under
    cProfile, 63 µs a call of ``oscar::attention`` and 92 µs of the mutating ``oscar::cache_write``,
    about 15 % of an INT2 layer's attention host time in a mixed step
    (bench/results/2026-12-05-gpu-int2-prefill-end-to-end, call 12). Same implementation, same
    arguments: the same launches. Under ``torch.compile`` the op is called as before."""
    return _DIRECT.get(op, op)


# ---------------------------------------------------------------- fused per-layer elementwise ops
@_register(RmsNormArgs)
def rms_norm(*args, **kwargs) -> Tensor:
    """Llama / Qwen RMSNorm over the last dimension (elementwise_ref.rms_norm_ref)."""
    return rms_norm_ref(**RmsNormArgs(*args, **kwargs)._asdict())


@rms_norm.register_fake
def _(*args, **kwargs):
    a = RmsNormArgs(*args, **kwargs)
    return a.x.new_empty(a.x.shape, dtype=torch.promote_types(a.x.dtype, a.weight.dtype))


_triton_on_cuda(rms_norm, RmsNormArgs, "elementwise.elementwise_triton", "rms_norm_triton", rms_norm_ref)


@_register(RopeArgs)
def rope(*args, **kwargs) -> tuple[Tensor, Tensor]:
    """Rotate-half RoPE of q [B, H_q, T, D] and k [B, H_kv, T, D], then (with ``rot``) ``oscar::rotate``
    of both, keys centred by ``mean``. Outputs are stored [B, T, H, D] (elementwise_ref.rope_ref)."""
    return rope_ref(**RopeArgs(*args, **kwargs)._asdict())


@rope.register_fake
def _(*args, **kwargs):
    a = RopeArgs(*args, **kwargs)
    B, H_q, T, D = a.q.shape
    dtype = torch.promote_types(a.cos.dtype, a.sin.dtype)  # as the reference's products promote
    return (a.q.new_empty(B, T, H_q, D, dtype=torch.promote_types(a.q.dtype, dtype)).transpose(1, 2),
            a.k.new_empty(B, T, a.k.shape[1], D, dtype=torch.promote_types(a.k.dtype, dtype)).transpose(1, 2))


@rope.register_kernel("cuda")
def _(*args, **kwargs):
    a = RopeArgs(*args, **kwargs)
    impl = _triton_impl("elementwise.elementwise_triton", "rope_triton")
    if impl is not None and _triton_impl("elementwise.elementwise_triton", "rope_supported")(a.q, a.k, a.cos, a.sin):
        return impl(**a._asdict())
    return rope_ref(**a._asdict())


@_register(SiluMulArgs)
def silu_mul(*args, **kwargs) -> Tensor:
    """The gated MLP's ``silu(gate) * up``."""
    return silu_mul_ref(**SiluMulArgs(*args, **kwargs)._asdict())


@silu_mul.register_fake
def _(*args, **kwargs):
    return torch.empty_like(SiluMulArgs(*args, **kwargs).gate)


_triton_on_cuda(silu_mul, SiluMulArgs, "elementwise.elementwise_triton", "silu_mul_triton", silu_mul_ref)
