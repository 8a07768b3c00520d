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
def folded_value_weights(w_v: torch.Tensor, b_v: torch.Tensor | None, w_o: torch.Tensor, rot_v: torch.Tensor,
                         num_heads: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The folded (v_proj weight, v_proj bias, o_proj weight), new tensors in the inputs' dtypes.

    w_v: [H_kv * D, hidden]; b_v: [H_kv * D] or None; w_o: [out, H_q * D]; rot_v: [H_kv, D, D].
    Math in float64, rounded once to each weight's dtype: what :func:`fold_value_rotation` stores,
    so a checkpoint written with these weights reproduces ``apply`` bit for bit.
    """
    H_kv, D, _ = rot_v.shape
    g = num_heads // H_kv
    r = rot_v.to(device=w_v.device, dtype=torch.float64)
    w = w_v.double().reshape(H_kv, D, -1)  # [H_kv, D, hidden]
    new_w_v = (r.transpose(1, 2) @ w).reshape(w_v.shape).to(w_v.dtype)
    new_b_v = None
    if b_v is not None:
        b = b_v.double().reshape(H_kv, D, 1)
        new_b_v = (r.transpose(1, 2) @ b).reshape(b_v.shape).to(b_v.dtype)
    r_o = r.to(w_o.device).repeat_interleave(g, dim=0)  # [H_q, D, D]: query head j uses R_V(j // g)
    wo = w_o.double().reshape(w_o.shape[0], num_heads, D).transpose(0, 1)  # [H_q, out, D]
    new_w_o = (wo @ r_o).transpose(0, 1).reshape(w_o.shape).to(w_o.dtype)
    return new_w_v, new_b_v, new_w_o


@torch.no_grad()
def fold_value_rotation(v_proj: nn.Linear, o_proj: nn.Linear, rot_v: torch.Tensor, num_heads: int) -> None:
    """rot_v: [H_kv, D, D]. Mutates the two projections in place (math in float64)."""
    w_v, b_v, w_o = folded_value_weights(v_proj.weight, v_proj.bias, o_proj.weight, rot_v, num_heads)
    v_proj.weight.copy_(w_v)
    if b_v is not None:
        v_proj.bias.copy_(b_v)
    o_proj.weight.copy_(w_o)
