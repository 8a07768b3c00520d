"""References for the fused per-layer ops (``oscar::rms_norm``, ``oscar::rope``, ``oscar::silu_mul``).

Why these exist: a decode step at batch 1 launches about fifty small kernels per layer besides the
GEMMs and attention (an RMSNorm alone is eight: upcast, pow, mean, add, rsqrt, mul, downcast, mul),
and on a GPU each costs a few microseconds whatever its size. The Triton versions do each in one
launch. These references are the Hugging Face formulas op for op, so on the CPU a fused model
computes bitwise what the original computes (passes/fuse_elementwise.py checks that on a probe
before it swaps anything).

- ``rms_norm_ref``: Llama / Qwen RMSNorm: float32 statistics, rounded to the input dtype, times weight.
- ``rope_ref``: ``apply_rotary_pos_emb`` (rotate-half RoPE, cos/sin ``[B, T, D]`` broadcast over
  heads), then optionally ``oscar::rotate`` of the queries and of the centred keys. Outputs are laid
  out ``[B, T, H, D]`` in memory (returned as ``[B, H, T, D]`` views), which is what the paged
  attention ops read without a copy; the Triton kernel writes the same layout.
- ``silu_mul_ref``: the gated MLP's ``silu(gate) * up``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from oscar_compile.kernels.elementwise.rotate_ref import rotate_ref


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """The same [B, H, T, D] values stored [B, T, H, D] (the fused kernel's output layout)."""
    B, H, T, D = x.shape
    return x.new_empty(B, T, H, D).transpose(1, 2).copy_(x)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             rot: torch.Tensor | None = None, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, H_q, T, D], k: [B, H_kv, T, D], cos/sin: [B, T, D]; rot [H_r, D, D] / mean [H_r, D] float32."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_out = (q * cos) + (_rotate_half(q) * sin)
    k_out = (k * cos) + (_rotate_half(k) * sin)
    if rot is not None:
        q_out, k_out = rotate_ref(q_out, rot), rotate_ref(k_out, rot, mean)
    return _token_major(q_out), _token_major(k_out)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
