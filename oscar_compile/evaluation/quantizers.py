"""Per-layer fake quantizers and the rule for which cached tokens a query reads quantized.

A quantizer turns a layer's keys and values [B, H_kv, T, D] into fake-quantized copies *in the
original coordinates* (rotate, clip, quantize, dequantize, rotate back), once per sequence, and
says through :class:`HistoryBounds` which copy query t sees for key p. That is all the simulated
cache needs (simulate.py): the compressed cache's state at the moment query t runs depends only
on how many tokens were cached then (``starts[t]``, see :func:`cache_starts`).

Rotating back is exact for the softmax: with R orthogonal and a centring mean mu,
``q . (deq R^T + mu) = (q R) . deq + q . mu`` and full-precision keys get the same ``+ q . mu``, so
every score of a query shifts by one constant, as in the rewritten model (docs/design.md §5).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..artifact import ArtifactError, Rotations
from ..formats.prefill import DECODE_CONSISTENT, PROMPT_EXACT, check_prefill_semantics
from ..quant import fake_quantize
from ..spec import LayerSpec


@dataclass
class HistoryBounds:
    """Query t reads key p quantized iff ``key_lo <= p < key_hi[t]`` (values likewise).

    key_hi, value_hi: [B|1, T] long. Spec methods share one rule for keys and values (``shared``).
    """

    key_lo: int
    key_hi: torch.Tensor
    value_lo: int
    value_hi: torch.Tensor

    @property
    def shared(self) -> bool:
        return self.key_lo == self.value_lo and self.key_hi is self.value_hi

    def masks(self, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key mask, value mask), each [B|1, T, num_keys] bool: True where the quantized copy is read."""
        p = torch.arange(num_keys, device=self.key_hi.device)
        mk = (p >= self.key_lo) & (p < self.key_hi[..., None])
        if self.shared:
            return mk, mk
        mv = (p >= self.value_lo) & (p < self.value_hi[..., None])
        return mk, mv


class LayerQuantizer(Protocol):
    def fake_quantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def bounds(self, starts: torch.Tensor) -> HistoryBounds: ...


def cache_starts(num_tokens: int, prefill: torch.Tensor | int = 0, chunk: torch.Tensor | int = 0,
                 device: torch.device | str = "cpu", semantics: str = PROMPT_EXACT) -> torch.Tensor:
    """Tokens already cached when each position's query runs: [B|1, T] long.

    Positions ``< prefill`` run as one prefill chunk (nothing cached: 0); the next ``chunk``
    positions run as a second chunk on top of the cached prefill (``prefill``); every later
    position is a decode step (``t``: all earlier tokens cached). ``prefill = chunk = 0`` is a
    teacher-forced decode of the whole sequence. prefill, chunk: ints or [B] tensors.

    Under the ``decode-consistent`` prefill semantics (formats/prefill.py) a prompt token reads
    the cache as a decode step at its position would, whatever the chunks: every position is
    ``t``, the teacher-forced decode.
    """
    t = torch.arange(num_tokens, device=device)[None, :]  # [1, T]
    if check_prefill_semantics(semantics) == DECODE_CONSISTENT:
        return t.long()
    p = torch.as_tensor(prefill, device=device).reshape(-1, 1)  # [B|1, 1]
    c = torch.as_tensor(chunk, device=device).reshape(-1, 1)
    starts = torch.where(t < p, torch.zeros_like(t), torch.where(t < p + c, p, t))
    return starts.long()


class SpecQuantizer:
    """One layer of a compression spec: rotate (and centre) keys, rotate values, clip, quantize.

    rot_k, rot_v: [H_kv, D, D] float32 orthogonal; mean: [H_kv, D] or None (no centring).
    """

    def __init__(self, layer: LayerSpec, rot_k: torch.Tensor, rot_v: torch.Tensor, mean: torch.Tensor | None):
        kv = layer.kv_cache
        self.bits, self.group_size, self.scale_dtype = kv.bits, kv.group_size, kv.scale_dtype
        self.sink, self.recent = kv.sink_tokens, kv.recent_tokens
        self.clip_k, self.clip_v = layer.key.clip_ratio, layer.value.clip_ratio
        self.rot_k, self.rot_v, self.mean = rot_k.float(), rot_v.float(), None if mean is None else mean.float()

    def to(self, device: torch.device) -> SpecQuantizer:
        self.rot_k, self.rot_v = self.rot_k.to(device), self.rot_v.to(device)
        self.mean = None if self.mean is None else self.mean.to(device)
        return self

    def fake_quantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H_kv, T, D] -> float32 fake-quantized copies in the original coordinates."""
        kc = k.float() if self.mean is None else k.float() - self.mean[None, :, None]
        kr = torch.einsum("bhtd,hde->bhte", kc, self.rot_k)
        kq = fake_quantize(kr, self.bits, self.group_size, self.clip_k, self.scale_dtype)
        k_sim = torch.einsum("bhte,hde->bhtd", kq, self.rot_k)
        if self.mean is not None:
            k_sim = k_sim + self.mean[None, :, None]
        vr = torch.einsum("bhtd,hde->bhte", v.float(), self.rot_v)
        vq = fake_quantize(vr, self.bits, self.group_size, self.clip_v, self.scale_dtype)
        return k_sim, torch.einsum("bhte,hde->bhtd", vq, self.rot_v)

    def bounds(self, starts: torch.Tensor) -> HistoryBounds:
        """History of a cache holding L = starts[t] tokens: positions [S0, L - W) (docs/cache-format.md)."""
        hi = starts - self.recent
        return HistoryBounds(key_lo=self.sink, key_hi=hi, value_lo=self.sink, value_hi=hi)


def spec_quantizers(layers: list[LayerSpec], rotations: Rotations, head_dim: int,
                    device: torch.device) -> list[SpecQuantizer | None]:
    """One quantizer per layer (None where the layer keeps a 16-bit cache)."""
    out: list[SpecQuantizer | None] = []
    for layer in layers:
        if not layer.quantized:
            out.append(None)
            continue
        i = layer.index
        mean = rotations.k_mean[i] if layer.key.center else None
        if layer.key.center and mean is None:
            raise ArtifactError(f"layer {i}: key.center is on but the rotation file has no key means (recalibrate)")
        out.append(SpecQuantizer(layer, rotations.k[i], rotations.v[i], mean).to(device))
    return out
