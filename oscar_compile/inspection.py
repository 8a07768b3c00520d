"""What ``oscar-compile inspect`` prints: per-layer health of a rotation artifact.

Importance (the OSCAR paper's Table 10): how peaky the diagonal of the covariance target is,
max_i C_ii / mean_i C_ii, before rotation (C) and after (R^T C R). 1.00 means every channel is
equally important to attention; Lemma 1 forces it for R = U H P.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .artifact import Rotations
from .rotation_math import orthogonality_error


@dataclass
class RotationHealth:
    layer: int
    kind: str  # "k" or "v"
    eigen_spread: float | None  # largest eigenvalue over the mean eigenvalue
    importance_before: float | None
    importance_after: float | None
    orthogonality_error: float


def _peak_over_mean(diag: torch.Tensor) -> float:
    return float((diag.amax(-1) / diag.mean(-1).clamp_min(1e-30)).max())


def rotation_health(rot: Rotations) -> list[RotationHealth]:
    rows = []
    for i in range(rot.num_layers):
        for kind, r in (("k", rot.k[i]), ("v", rot.v[i])):
            cov = rot.extra(i, f"{kind}_cov")
            eig = rot.extra(i, f"{kind}_eigenvalues")
            before = after = spread = None
            if cov is not None:
                c, rr = cov.double(), r.double()
                if bool((rr == rr[:1]).all()):  # one rotation per layer: fit to the head-averaged target
                    c, rr = c.mean(0, keepdim=True), rr[:1]
                before = _peak_over_mean(torch.diagonal(c, dim1=-2, dim2=-1))
                after = _peak_over_mean(torch.diagonal(rr.transpose(-1, -2) @ c @ rr, dim1=-2, dim2=-1))
            if eig is not None:
                spread = _peak_over_mean(eig.double())
            rows.append(RotationHealth(i, kind, spread, before, after, orthogonality_error(r)))
    return rows


def format_health(rot: Rotations) -> str:
    fp = rot.fingerprint
    spec = rot.spec
    head = [
        f"{fp.architecture}: {fp.num_layers} layers, {fp.num_heads} query / {fp.num_kv_heads} KV heads, "
        f"head_dim {fp.head_dim}",
        f"key: {spec.key.rotation} {spec.key.granularity} clip {spec.key.clip_ratio} center {spec.key.center}; "
        f"value: {spec.value.rotation} {spec.value.granularity} clip {spec.value.clip_ratio} "
        f"target {spec.value.target}; "
        f"calibrated on {rot.num_tokens} tokens",
        "",
        f"{'layer':>5} {'kind':>4} {'eig max/mean':>12} {'importance before':>17} {'after':>7} {'|RtR-I|':>9}",
    ]

    def f(x, width, fmt):
        return f"{'-':>{width}}" if x is None else f"{x:>{width}{fmt}}"

    lines = [
        f"{h.layer:>5} {h.kind:>4} {f(h.eigen_spread, 12, '.2f')} {f(h.importance_before, 17, '.2f')} "
        f"{f(h.importance_after, 7, '.2f')} {h.orthogonality_error:>9.1e}"
        for h in rotation_health(rot)
    ]
    return "\n".join(head + lines)
