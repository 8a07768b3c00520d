"""Fold the value rotation R_V into v_proj and o_proj: zero runtime cost (docs/design.md §5).

With nn.Linear (y = x W^T + b) and R_V(h) orthogonal:
  v_proj rows of KV head h:             W[h] <- R_V(h)^T @ W[h],  b[h] <- R_V(h)^T @ b[h]
  o_proj input columns of query head j: W_O[:, j] <- W_O[:, j] @ R_V(j // g)
so v' = v R_V and W_O' v' = W_O v: attention mixes values linearly per head, so the product
is unchanged while the cache holds v in the rotated basis.
"""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fold_value_rotation(v_proj: nn.Linear, o_proj: nn.Linear, rot_v: torch.Tensor, num_heads: int) -> None:
    """rot_v: [H_kv, D, D]. Mutates the two projections in place (math in float64)."""
    H_kv, D, _ = rot_v.shape
    g = num_heads // H_kv
    r = rot_v.to(device=v_proj.weight.device, dtype=torch.float64)
    w = v_proj.weight.double().reshape(H_kv, D, -1)  # [H_kv, D, hidden]
    v_proj.weight.copy_((r.transpose(1, 2) @ w).reshape_as(v_proj.weight))
    if v_proj.bias is not None:
        b = v_proj.bias.double().reshape(H_kv, D, 1)
        v_proj.bias.copy_((r.transpose(1, 2) @ b).reshape_as(v_proj.bias))
    r_o = r.to(o_proj.weight.device).repeat_interleave(g, dim=0)  # [H_q, D, D]: query head j uses R_V(j // g)
    wo = o_proj.weight.double().reshape(o_proj.weight.shape[0], num_heads, D).transpose(0, 1)  # [H_q, out, D]
    o_proj.weight.copy_((wo @ r_o).transpose(0, 1).reshape_as(o_proj.weight))
