"""Reference for ``oscar::rotate``: centre then rotate per head, plain torch (no Triton).

Math, per head h of x (H heads sharing H_r rotations, H_r = rot.shape[0] dividing H):
    r = h // (H / H_r)
    y[b, h, t] = (x[b, h, t] - mean[r]) @ rot[r]          (row vectors)
- ``rot: [H_r, D, D]`` float32. A per-layer rotation is H_r = 1; per-KV-head rotations are
  H_r = H_kv, and the same tensor serves the queries (H = H_q, query head j uses rot[j // g]).
- ``mean`` (keys only; queries are never centred) is subtracted *before* the rotation, in the
  original basis; the rotated mean ``mu R`` is not what is passed here.
- All math in float32 (x is upcast first), the result is rounded once to x.dtype.
- In deterministic mode (``kernels.determinism``) the product goes through ``linear_tiled``, so a
  token's result does not depend on how many tokens share the call.
"""
from __future__ import annotations

import torch

from oscar_compile.kernels.determinism import is_deterministic
from oscar_compile.kernels.matmul.matmul_ref import linear_tiled


def check_rotate_args(x: torch.Tensor, rot: torch.Tensor, mean: torch.Tensor | None) -> None:
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, T, D], got shape {tuple(x.shape)}")
    D, H = x.shape[-1], x.shape[1]
    if rot.dim() != 3 or rot.shape[1:] != (D, D):
        raise ValueError(f"rot must be [H_r, {D}, {D}], got {tuple(rot.shape)}")
    if H % rot.shape[0]:
        raise ValueError(f"{rot.shape[0]} rotations do not divide {H} heads")
    if mean is not None and mean.shape != (rot.shape[0], D):
        raise ValueError(f"mean must be [{rot.shape[0]}, {D}], got {tuple(mean.shape)}")


def rotate_ref(x: torch.Tensor, rot: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """(x - mean[h // g]) @ rot[h // g]. x: [B, H, T, D] -> [B, H, T, D] in x.dtype."""
    check_rotate_args(x, rot, mean)
    B, H, T, D = x.shape
    H_r = rot.shape[0]
    xf = x.float().reshape(B, H_r, H // H_r, T, D)  # [B, H_r, g, T, D]
    if mean is not None:
        xf = xf - mean.float().view(1, H_r, 1, 1, D)
    if is_deterministic():
        rows = xf.transpose(0, 1).reshape(H_r, -1, D)  # [H_r, B * g * T, D]
        out = torch.stack([linear_tiled(rows[r], rot[r].float().T) for r in range(H_r)])
        out = out.view(H_r, B, H // H_r, T, D).transpose(0, 1)
    else:
        out = torch.matmul(xf, rot.float().view(1, H_r, 1, D, D))
    return out.reshape(B, H, T, D).to(x.dtype)
