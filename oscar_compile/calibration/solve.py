"""From a layer's running sums to its rotations: R = U · H · P_br per KV head or per layer."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..architectures import ModelFingerprint
from ..rotation_math import hadamard_rotation, identity_rotation, oscar_rotation
from ..spec import LayerSpec
from .stats import LayerStats


@dataclass
class SolvedLayer:
    k: torch.Tensor  # [H_kv, D, D]
    v: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def _rotation(method: str, granularity: str, target_fn, fp: ModelFingerprint, name: str, extras: dict) -> torch.Tensor:
    H, D = fp.num_kv_heads, fp.head_dim
    if method == "none":
        return identity_rotation(H, D)
    if method == "hadamard":
        return hadamard_rotation(H, D)
    # oscar, and optr's starting point (its per-head corrections are learned afterwards, optr.py)
    cov = target_fn().double().cpu()  # [H_kv, D, D]
    extras[f"{name}_cov"] = cov.float()
    if granularity == "per_layer":
        r, ev = oscar_rotation(cov.mean(dim=0))
        r, ev = r.expand(H, D, D).clone(), ev.expand(H, D).clone()
    else:
        r, ev = oscar_rotation(cov)
    extras[f"{name}_eigenvalues"] = ev
    return r


def solve_layer(layer: LayerSpec, stats: LayerStats, fp: ModelFingerprint) -> SolvedLayer:
    extras: dict[str, torch.Tensor] = {}
    k = _rotation(layer.key.rotation, layer.key.granularity, stats.query_cov, fp, "k", extras)
    value_target = stats.score_weighted_value_cov if layer.value.target == "score_weighted" else stats.output_cov
    v = _rotation(layer.value.rotation, layer.value.granularity, value_target, fp, "v", extras)
    if stats.num_tokens:
        extras["k_mean"] = stats.key_mean().float().cpu()
    return SolvedLayer(k=k, v=v, extras=extras)
