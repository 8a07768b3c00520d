"""A KIVI-style baseline (Liu et al. 2024), simulated: it is not a rotation, so it is no spec.

KIVI quantizes keys **per channel** (each channel's min/max taken over a group of G consecutive
tokens) and values **per token** (groups of G channels), asymmetric min-max, no clipping, and keeps
a full-precision residual of recent tokens, with no sink. Its cache bookkeeping (KIVI's reference
code) fixes *when* a token is quantized, which the masks below reproduce:

* keys: a full-precision residual fills up to R tokens and is then quantized as one block, so with
  L tokens cached the keys ``p < R * floor(L / R)`` are quantized (blocks aligned to position 0);
* values: the R most recent stay in full precision, so values ``p < L - R`` are quantized.

Because the key groups are aligned token blocks, every token's fake-quantized key is fixed once
the whole sequence is known, which is what lets one fake-quantization per sequence plus masks stand
in for the step-by-step cache. Defaults are the KIVI paper's (G = 32, R = 128): with fp16 scale
and zero that is 2 + 32/32 = 3 bits per quantized element, counted honestly in
:func:`kivi_bits_per_element`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..quant import scale_dtype_of
from .quantizers import HistoryBounds

_NAME = re.compile(r"^kivi-int(?P<bits>[24])(?:-g(?P<group>\d+))?(?:-r(?P<residual>\d+))?$")


@dataclass(frozen=True)
class KiviConfig:
    bits: int = 2
    group_size: int = 32  # tokens per key group (per channel) and channels per value group
    residual: int = 128  # full-precision recent tokens; a multiple of group_size
    scale_dtype: str = "float16"

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.residual < self.group_size or self.residual % self.group_size:
            raise ValueError(
                f"KIVI residual ({self.residual}) must be a positive multiple of its group size ({self.group_size})"
            )

    @property
    def name(self) -> str:
        return f"kivi-int{self.bits}-g{self.group_size}-r{self.residual}"


def parse_kivi_name(name: str) -> KiviConfig | None:
    """``kivi-int2`` / ``kivi-int4`` with optional ``-g<G>`` and ``-r<R>`` (e.g. ``kivi-int2-g128-r256``)."""
    m = _NAME.match(name)
    if m is None:
        return None
    kwargs = {"bits": int(m["bits"])}
    if m["group"]:
        kwargs["group_size"] = int(m["group"])
    if m["residual"]:
        kwargs["residual"] = int(m["residual"])
    return KiviConfig(**kwargs)


def minmax_fake_quantize(x: torch.Tensor, bits: int, group_size: int, scale_dtype: str = "float16") -> torch.Tensor:
    """KIVI's asymmetric min-max in groups along the last dim, stored as (scale, min): x [..., D] -> float32.

    ``code = clamp(round((x - mn) / s), 0, 2^b - 1)``, dequant ``code * s + mn``, with s and mn
    rounded to ``scale_dtype`` first. Storing the minimum rather than a zero point ``-mn / s`` (as
    KIVI does) keeps nearly constant groups finite: per-channel groups over tokens meet them (a
    repeated token in a slowly rotating RoPE channel), and ``-mn / s`` would overflow fp16 there.
    A constant group dequantizes to its (rounded) value.
    """
    sdt = scale_dtype_of(scale_dtype)
    qmax = 2**bits - 1
    xg = x.float().unflatten(-1, (-1, group_size))  # [..., D/G, G]
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    scale, lo = ((hi - lo) / qmax).to(sdt).float(), lo.to(sdt).float()
    codes = torch.clamp(torch.round((xg - lo) / torch.where(scale == 0, torch.ones_like(scale), scale)), 0, qmax)
    return (codes * scale + lo).flatten(-2)


def kivi_fake_quantize_keys(k: torch.Tensor, cfg: KiviConfig) -> torch.Tensor:
    """Per-channel fake quantization over aligned blocks of G tokens. k: [B, H, T, D] -> float32.

    The tail of fewer than G tokens is returned unchanged: KIVI never quantizes an incomplete block
    (those tokens are still in its residual).
    """
    T = k.shape[2]
    full = (T // cfg.group_size) * cfg.group_size
    out = k.float().clone()
    if full:
        x = out[:, :, :full].transpose(-1, -2)  # [B, H, D, full]: groups run along tokens
        out[:, :, :full] = minmax_fake_quantize(x, cfg.bits, cfg.group_size, cfg.scale_dtype).transpose(-1, -2)
    return out


def kivi_fake_quantize_values(v: torch.Tensor, cfg: KiviConfig) -> torch.Tensor:
    """Per-token fake quantization in groups of G channels. v: [B, H, T, D] -> float32."""
    return minmax_fake_quantize(v, cfg.bits, cfg.group_size, cfg.scale_dtype)


class KiviQuantizer:
    """The KIVI baseline for one layer, in the simulation's quantizer protocol."""

    def __init__(self, cfg: KiviConfig, head_dim: int):
        if head_dim % cfg.group_size:
            raise ValueError(f"{cfg.name}: value group size {cfg.group_size} does not divide head_dim {head_dim}")
        self.cfg = cfg

    def fake_quantize(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: [B, H_kv, T, D] -> float32 fake-quantized copies, same coordinates."""
        return kivi_fake_quantize_keys(k, self.cfg), kivi_fake_quantize_values(v, self.cfg)

    def bounds(self, starts: torch.Tensor) -> HistoryBounds:
        """starts: [B|1, T] tokens cached when query t ran -> which keys/values it reads quantized."""
        R = self.cfg.residual
        return HistoryBounds(key_lo=0, key_hi=(starts // R) * R, value_lo=0, value_hi=starts - R)


def kivi_bits_per_element(cfg: KiviConfig, context: int | None = None) -> float:
    """Stored bits per K/V element: payload + fp16 scale/zero per group, the residual at 16 bits."""
    sdt_bits = torch.finfo(scale_dtype_of(cfg.scale_dtype)).bits
    quant_bits = cfg.bits + 2 * sdt_bits / cfg.group_size
    if context is None:
        return quant_bits
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    num_k = (context // cfg.residual) * cfg.residual
    num_v = max(0, context - cfg.residual)
    num_fp = 2 * context - num_k - num_v
    return ((num_k + num_v) * quant_bits + num_fp * 16) / (2 * context)
