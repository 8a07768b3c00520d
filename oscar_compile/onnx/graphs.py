"""The two torch modules exported to ONNX: a model step over the INT2 cache, and the demotion quantizer.

Both reuse the project's code rather than restating it: the step runs the Hugging Face model's own
forward (embeddings, norms, RoPE, MLPs, head) with R_V folded into its weights
(``passes.fold_values``) and only the attention core replaced (``attention_override``); the
dequantization and the quantizer are ``oscar_compile.quant``'s reference functions, traced. So the
ONNX graphs compute what ``apply()`` + ``generate()`` compute, in the same float32 order of rules.

Cache state of one layer, token-major so a driver passes the first n rows of a preallocated
buffer without a copy (H = H_kv, D = head_dim, G = group size, b = bits):
  sink_k, sink_v           [S, H, D] float32      the first min(L, S0) positions
  hist_k_codes, _v_codes   [N, H, D * b / 8] uint8 planar-packed codes, or, where the cache
                           format stores masked INT2 (INT2 at D = 128: formats.cache.code_layout),
                           [ceil(N / 16), H, 512] uint8: 16-token blocks in the pools' byte
                           order (kernels/layout/code_layout_ref.py), the last one partly filled
  hist_k_scale/_zero, v    [N, H, D / G] scale dtype
  recent_k, recent_v       [R, H, D] float32      the recent window, in any order (a ring)
Attention is a sum over keys, so the order of cached tokens does not matter; only the new tokens
need a causal mask among themselves.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import quant
from ..attention_override import override_attention
from ..kernels.layout.code_layout_ref import unpack_blocks

CACHE_FIELDS = ("sink_k", "sink_v", "hist_k_codes", "hist_k_scale", "hist_k_zero",
                "hist_v_codes", "hist_v_scale", "hist_v_zero", "recent_k", "recent_v")


def cache_input_names(num_layers: int) -> list[str]:
    return [f"{name}.{i}" for i in range(num_layers) for name in CACHE_FIELDS]


def new_kv_output_names(num_layers: int) -> list[str]:
    return [f"new_{kind}.{i}" for i in range(num_layers) for kind in ("k", "v")]


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, scaling: float) -> torch.Tensor:
    """q: [H_kv, g, T, D]; keys, vals: [H_kv, L + T, D] (the last T are the new tokens) -> [T, H_kv * g, D].

    New token t sees every cached key and the new keys 0..t. Float32 scores, softmax and sum.
    """
    H_kv, g, T, D = q.shape
    num_keys = keys.shape[1]
    scores = torch.einsum("hgtd,hsd->hgts", q, keys) * scaling
    num_cached = num_keys - T
    key_pos = torch.arange(num_keys, device=q.device).view(1, num_keys)
    query_pos = (torch.arange(T, device=q.device) + num_cached).view(T, 1)
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgts,hsd->hgtd", probs, vals)  # [H_kv, g, T, D]
    return out.reshape(H_kv * g, T, D).transpose(0, 1)


class StepGraph(nn.Module):
    """One forward of ``model`` (batch 1) over its INT2 cache state; the new keys and values out.

    forward(input_ids [1, T] int64, position_ids [1, T] int64, *cache (CACHE_FIELDS per layer))
      -> (logits [1, T, V] float32, new_k.0, new_v.0, ...: [T, H_kv, D] float32)
    New keys leave rotated (and centred): k' = (RoPE(k) - mu) R_K; values in the R_V basis.
    """

    def __init__(self, model: nn.Module, rot_k: list[torch.Tensor], k_mean: list, bits: int, group_size: int,
                 masked: bool = False):
        super().__init__()
        self.model = model
        self.num_layers = len(rot_k)
        self.bits, self.group_size, self.masked = bits, group_size, masked
        for i, (r, mu) in enumerate(zip(rot_k, k_mean, strict=True)):
            self.register_buffer(f"rot_k_{i}", r.float().contiguous())  # [H_kv, D, D]
            self.register_buffer(f"k_mean_{i}", (mu if mu is not None else torch.zeros(r.shape[:2])).float())

    def _layer_attention(self, cache: list[tuple], new_kv: dict):
        def fn(layer, module, q, k, v, kwargs, run_inner):
            sink_k, sink_v, kc, ks, kz, vc, vs, vz, recent_k, recent_v = cache[layer]
            rot, mean = getattr(self, f"rot_k_{layer}"), getattr(self, f"k_mean_{layer}")
            H_kv, D = rot.shape[0], rot.shape[1]
            T = q.shape[2]
            g = q.shape[1] // H_kv
            k_rot = torch.einsum("htd,hde->hte", k[0].float() - mean.unsqueeze(1), rot)  # [H_kv, T, D]
            q_rot = torch.einsum("hgtd,hde->hgte", q[0].float().reshape(H_kv, g, T, D), rot)
            v_new = v[0].float()  # [H_kv, T, D]
            hist_k = self._dequantize(kc, ks, kz, "k")  # [N, H_kv, D]
            hist_v = self._dequantize(vc, vs, vz, "v")
            keys = torch.cat([sink_k, hist_k, recent_k], dim=0).transpose(0, 1)  # [H_kv, L, D]
            vals = torch.cat([sink_v, hist_v, recent_v], dim=0).transpose(0, 1)
            keys = torch.cat([keys, k_rot], dim=1)
            vals = torch.cat([vals, v_new], dim=1)
            scaling = kwargs.get("scaling") or module.scaling
            out = _attend(q_rot, keys, vals, scaling)  # [T, H_q, D]
            new_kv[layer] = (k_rot.transpose(0, 1), v_new.transpose(0, 1))
            return out.unsqueeze(0).to(q.dtype), None

        return fn

    def _dequantize(self, codes, scale, zero, kind: str) -> torch.Tensor:
        """History rows [N, H_kv, D] float32 from planar rows or masked 16-token blocks."""
        if not self.masked:
            return quant.dequantize(codes, scale, zero, self.bits, self.group_size)
        blocks = unpack_blocks(codes, kind)  # [NB, H_kv, 16, D]
        rows = blocks.transpose(1, 2).reshape(-1, blocks.shape[1], blocks.shape[3])  # [16 NB, H_kv, D]
        return quant.dequantize_groups(rows[: scale.shape[0]], scale, zero, self.group_size)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *cache_flat: torch.Tensor):
        n = len(CACHE_FIELDS)
        cache = [cache_flat[i * n:(i + 1) * n] for i in range(self.num_layers)]
        new_kv: dict[int, tuple] = {}
        with override_attention(self.model, self._layer_attention(cache, new_kv)):
            logits = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        outs = [logits.float()]
        for i in range(self.num_layers):
            outs.extend(new_kv[i])
        return tuple(outs)


class QuantizeGraph(nn.Module):
    """Demotion: tokens leaving the recent window, quantized by the reference quantizer.

    forward(k [n, H_kv, D] float32, v [n, H_kv, D] float32) -> (k_codes [n, H_kv, D*b/8] uint8,
    k_scale, k_zero [n, H_kv, D/G], v_codes, v_scale, v_zero): ``quant.quantize`` (per-token clip
    at the rho-quantile, per-group min-max, round half to even, planar packing), keys with
    ``clip_k`` and values with ``clip_v``. ``masked``: the codes leave unpacked, [n, H_kv, D]
    uint8, and the driver ORs each token's bit pairs into its 16-token block.
    """

    def __init__(self, bits: int, group_size: int, clip_k: float, clip_v: float, scale_dtype: str,
                 masked: bool = False):
        super().__init__()
        self.bits, self.group_size, self.clip_k, self.clip_v = bits, group_size, clip_k, clip_v
        self.scale_dtype, self.masked = scale_dtype, masked

    def forward(self, k: torch.Tensor, v: torch.Tensor):
        if self.masked:
            kq = quant.quantize_groups(quant.clip_per_token(k, self.clip_k), self.bits, self.group_size,
                                       self.scale_dtype)
            vq = quant.quantize_groups(quant.clip_per_token(v, self.clip_v), self.bits, self.group_size,
                                       self.scale_dtype)
        else:
            kq = quant.quantize(k, self.bits, self.group_size, self.clip_k, self.scale_dtype)
            vq = quant.quantize(v, self.bits, self.group_size, self.clip_v, self.scale_dtype)
        return (*kq, *vq)
