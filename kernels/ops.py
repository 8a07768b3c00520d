"""The ``oscar::`` custom ops: one registration per kernel, plain-torch reference everywhere, Triton on CUDA.

Signatures follow docs/cache-format.md. Each op is a ``torch.library.custom_op`` with a fake
(meta) implementation so ``torch.compile(fullgraph=True)`` traces through it. The default
implementation (CPU and any device without a kernel) is the ``*_ref`` module; on CUDA the Triton
wrapper runs when Triton is importable, else the reference. ``oscar::attention`` on sm_90 runs
the Gluon kernel for decode-like INT2 batches, and on any GPU prefill-like INT-b calls take the
extend path (history dequantized once, then the paged BF16 kernel; ``attention_dispatch``:
``OSCAR_ATTENTION_KERNEL``).

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
from typing import Optional

import torch
from torch import Tensor

from oscar_compile.kernels.attention_bf16_ref import attention_bf16_ref, cache_write_bf16_ref
from oscar_compile.kernels.attention_ref import attention_ref
from oscar_compile.kernels.cache_write_ref import cache_write_ref
from oscar_compile.kernels.elementwise_ref import rms_norm_ref, rope_ref, silu_mul_ref
from oscar_compile.kernels.pools import CachePools, allocate_pools  # noqa: F401  (re-export)
from oscar_compile.kernels.rotate_ref import rotate_ref

_POOLS = ("k_win", "v_win", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton can be imported (checked once, without importing it here)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _triton_impl(module: str, name: str):
    """The Triton wrapper ``oscar_compile.kernels.<module>.<name>``, or None without Triton / module."""
    full = f"oscar_compile.kernels.{module}"
    if not triton_available() or importlib.util.find_spec(full) is None:
        return None
    return getattr(importlib.import_module(full), name)


def _rotate_tokens_ref(k: Tensor, rot: Tensor, mean: Optional[Tensor]) -> Tensor:
    # k: [N, H_kv, D] -> rotate sees [1, H_kv, N, D]
    return rotate_ref(k.transpose(0, 1).unsqueeze(0), rot, mean).squeeze(0).transpose(0, 1)


# ---------------------------------------------------------------- oscar::rotate
@torch.library.custom_op("oscar::rotate", mutates_args=())
def rotate(x: Tensor, rot: Tensor, mean: Optional[Tensor] = None) -> Tensor:
    """(x - mean[h // g]) @ rot[h // g]; x: [B, H, T, D], rot: [H_r, D, D] f32, mean: [H_r, D] f32.

    One batched float32 matmul on every device, no Triton kernel: with ``apply(fuse=True)`` (the
    default) the key and query rotation runs inside ``oscar::rope`` instead."""
    return rotate_ref(x, rot, mean)


@rotate.register_fake
def _(x, rot, mean=None):
    return torch.empty_like(x)


# ---------------------------------------------------------------- oscar::cache_write
@torch.library.custom_op("oscar::cache_write", mutates_args=_POOLS)
def cache_write(
    k: Tensor, v: Tensor, cu_seqlens: Tensor, cache_lens: Tensor,
    window_table: Tensor, quant_table: Tensor,
    k_win: Tensor, v_win: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor,
    sink: int, recent: int, bits: int, group_size: int, clip_k: float, clip_v: float,
    rot_k: Optional[Tensor] = None, mean_k: Optional[Tensor] = None,
    history_lens: Optional[Tensor] = None,
) -> None:
    """Write new tokens k, v: [N, H_kv, D] into the pools (see cache_write_ref for the rules)."""
    if rot_k is not None:
        k = _rotate_tokens_ref(k, rot_k, mean_k)
    cache_write_ref(k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win,
                    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                    sink, recent, bits, group_size, clip_k, clip_v, history_lens)


@cache_write.register_fake
def _(*args, **kwargs):
    return None


@cache_write.register_kernel("cuda")
def _(k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win, k_codes, k_scale,
      k_zero, v_codes, v_scale, v_zero, sink, recent, bits, group_size, clip_k, clip_v,
      rot_k=None, mean_k=None, history_lens=None):
    args = (k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win, k_codes,
            k_scale, k_zero, v_codes, v_scale, v_zero, sink, recent, bits, group_size, clip_k, clip_v)
    impl = _triton_impl("cache_write_triton", "cache_write_triton")
    head_dim = k.shape[-1]
    if impl is not None and not head_dim & (head_dim - 1):  # the kernel tiles D: a power of two
        return impl(*args, rot_k=rot_k, mean_k=mean_k, history_lens=history_lens)
    # other head dims (80, 96, ...) take the reference, as oscar::attention does (attention_triton)
    if rot_k is not None:
        k = _rotate_tokens_ref(k, rot_k, mean_k)
    cache_write_ref(k, *args[1:], history_lens=history_lens)


# ---------------------------------------------------------------- oscar::attention
@torch.library.custom_op("oscar::attention", mutates_args=())
def attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cache_lens: Tensor,
    window_table: Tensor, quant_table: Tensor,
    k_win: Tensor, v_win: Tensor, k_codes: Tensor, k_scale: Tensor, k_zero: Tensor,
    v_codes: Tensor, v_scale: Tensor, v_zero: Tensor,
    scale: float, sink: int, recent: int, bits: int, group_size: int,
    history_lens: Optional[Tensor] = None,
) -> Tensor:
    """New tokens q: [N, H_q, D] attend to the cache plus their own chunk, causally -> [N, H_q, D]."""
    return attention_ref(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win,
                         k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                         scale, sink, recent, bits, group_size, history_lens)


@attention.register_fake
def _(q, *args):
    return torch.empty_like(q)


@attention.register_kernel("cuda")
def _(*args):  # positional, as the dispatcher passes them (history_lens only when given)
    # the Gluon Hopper kernel or the Triton one: kernels/attention_dispatch.py chooses
    impl = _triton_impl("attention_dispatch", "attention_cuda")
    if impl is not None:
        return impl(*args)
    return attention_ref(*args)


# ---------------------------------------------------------------- full-precision paged cache
@torch.library.custom_op("oscar::cache_write_bf16", mutates_args=("k_pages", "v_pages"))
def cache_write_bf16(
    k: Tensor, v: Tensor, cu_seqlens: Tensor, cache_lens: Tensor, page_table: Tensor,
    k_pages: Tensor, v_pages: Tensor,
) -> None:
    """Scatter new tokens into full-precision pages (one Triton launch on CUDA)."""
    cache_write_bf16_ref(k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages)


@cache_write_bf16.register_fake
def _(*args):
    return None


@cache_write_bf16.register_kernel("cuda")
def _(*args):
    impl = _triton_impl("attention_bf16_triton", "cache_write_bf16_triton")
    return impl(*args) if impl is not None else cache_write_bf16_ref(*args)


@torch.library.custom_op("oscar::attention_bf16", mutates_args=())
def attention_bf16(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, cache_lens: Tensor, page_table: Tensor,
    k_pages: Tensor, v_pages: Tensor, scale: float,
) -> Tensor:
    """New tokens attend to full-precision pages plus their own chunk, causally -> [N, H_q, D]."""
    return attention_bf16_ref(q, k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages, scale)


@attention_bf16.register_fake
def _(q, *args):
    return torch.empty_like(q)


@attention_bf16.register_kernel("cuda")
def _(*args):
    impl = _triton_impl("attention_bf16_triton", "attention_bf16_triton")
    if impl is not None:
        return impl(*args)
    return attention_bf16_ref(*args)


# ---------------------------------------------------------------- fused per-layer elementwise ops
@torch.library.custom_op("oscar::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama / Qwen RMSNorm over the last dimension (elementwise_ref.rms_norm_ref)."""
    return rms_norm_ref(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@rms_norm.register_kernel("cuda")
def _(x, weight, eps):
    impl = _triton_impl("elementwise_triton", "rms_norm_triton")
    return impl(x, weight, eps) if impl is not None else rms_norm_ref(x, weight, eps)


@torch.library.custom_op("oscar::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
         rot: Optional[Tensor] = None, mean: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Rotate-half RoPE of q [B, H_q, T, D] and k [B, H_kv, T, D], then (with ``rot``) ``oscar::rotate``
    of both, keys centred by ``mean``. Outputs are stored [B, T, H, D] (elementwise_ref.rope_ref)."""
    return rope_ref(q, k, cos, sin, rot, mean)


@rope.register_fake
def _(q, k, cos, sin, rot=None, mean=None):
    B, H_q, T, D = q.shape
    dtype = torch.promote_types(cos.dtype, sin.dtype)  # as the reference's products promote
    return (q.new_empty(B, T, H_q, D, dtype=torch.promote_types(q.dtype, dtype)).transpose(1, 2),
            k.new_empty(B, T, k.shape[1], D, dtype=torch.promote_types(k.dtype, dtype)).transpose(1, 2))


@rope.register_kernel("cuda")
def _(q, k, cos, sin, rot=None, mean=None):
    impl = _triton_impl("elementwise_triton", "rope_triton")
    if impl is not None and _triton_impl("elementwise_triton", "rope_supported")(q, k, cos, sin):
        return impl(q, k, cos, sin, rot, mean)
    return rope_ref(q, k, cos, sin, rot, mean)


@torch.library.custom_op("oscar::silu_mul", mutates_args=())
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """The gated MLP's ``silu(gate) * up``."""
    return silu_mul_ref(gate, up)


@silu_mul.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@silu_mul.register_kernel("cuda")
def _(gate, up):
    impl = _triton_impl("elementwise_triton", "silu_mul_triton")
    return impl(gate, up) if impl is not None else silu_mul_ref(gate, up)
