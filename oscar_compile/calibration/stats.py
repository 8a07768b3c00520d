"""Running sums for the covariance targets of docs/design.md §3, one object per layer.

Memory is O(H_kv * D^2) whatever the number of tokens. Sums are float64 and live on the device
of the layer they watch. The score-weighted value target needs the *final* query covariance in
its weights, w_t = k_t C_Q(h) k_t^T, so it is a second pass over the data (``add_value_weights``)
after the first (``add``) has finished C_Q.
"""
from __future__ import annotations

import torch


def _gram(x: torch.Tensor) -> torch.Tensor:
    """x: [H, N, D] -> [H, D, D] = sum over tokens of x_t^T x_t, in float64."""
    x = x.double()
    return x.transpose(-1, -2) @ x


def _by_kv_head(x: torch.Tensor, num_kv_heads: int, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, H, T, D] -> [H_kv, n, D]: every token of every query head of a KV head, masked tokens dropped."""
    B, H, T, D = x.shape
    x = x.transpose(1, 2)  # [B, T, H, D]
    x = x[mask.to(x.device)] if mask is not None else x.reshape(B * T, H, D)  # [n, H, D]
    n = x.shape[0]
    # query head j reads KV head j // g: group the g heads of each KV head together
    return x.transpose(0, 1).reshape(num_kv_heads, (H // num_kv_heads) * n, D)


class LayerStats:
    """Sums over calibration tokens for one attention layer."""

    def __init__(self, num_kv_heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.num_tokens = 0
        self.gqa_ratio = 0
        self.qq: torch.Tensor | None = None  # [H_kv, D, D] sum over tokens and the g query heads
        self.oo: torch.Tensor | None = None  # same, attention outputs (the value target C_S)
        self.k_sum: torch.Tensor | None = None  # [H_kv, D]
        self.wvv: torch.Tensor | None = None  # [H_kv, D, D] sum of w_t v_t^T v_t
        self.w_sum: torch.Tensor | None = None  # [H_kv]

    @staticmethod
    def _acc(total: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        return new if total is None else total + new.to(total.device)

    def add(self, q: torch.Tensor, k: torch.Tensor, out: torch.Tensor, mask: torch.Tensor | None) -> None:
        """q: [B, H_q, T, D], k: [B, H_kv, T, D], out: [B, T, H_q, D], mask: [B, T] bool or None."""
        self.gqa_ratio = q.shape[1] // k.shape[1]
        qs = _by_kv_head(q, self.num_kv_heads, mask)
        ks = _by_kv_head(k, self.num_kv_heads, mask)
        os_ = _by_kv_head(out.transpose(1, 2), self.num_kv_heads, mask)
        self.num_tokens += ks.shape[1]
        self.qq = self._acc(self.qq, _gram(qs))
        self.oo = self._acc(self.oo, _gram(os_))
        self.k_sum = self._acc(self.k_sum, ks.double().sum(dim=1))

    def add_value_weights(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Second pass: accumulate w_t v_t^T v_t with w_t = k_t C_Q(h) k_t^T (C_Q from the first pass)."""
        ks = _by_kv_head(k, self.num_kv_heads, mask).double()  # [H_kv, n, D]
        vs = _by_kv_head(v, self.num_kv_heads, mask).double()
        cq = self.query_cov().to(ks.device)
        w = torch.einsum("hnd,hde,hne->hn", ks, cq, ks)  # [H_kv, n]
        self.wvv = self._acc(self.wvv, (vs * w[..., None]).transpose(-1, -2) @ vs)
        self.w_sum = self._acc(self.w_sum, w.sum(dim=1))

    # -- the targets, per KV head [H_kv, D, D] ---------------------------------------------
    def _need(self) -> None:
        if self.num_tokens == 0:
            raise ValueError("no calibration tokens reached this layer")

    def query_cov(self) -> torch.Tensor:
        """C_Q(h) = 1/(N g) * sum over the g query heads of KV head h and the N tokens of q^T q."""
        self._need()
        return self.qq / (self.num_tokens * self.gqa_ratio)

    def output_cov(self) -> torch.Tensor:
        """C_S(h): second moment of the causal attention outputs of the heads sharing KV head h."""
        self._need()
        return self.oo / (self.num_tokens * self.gqa_ratio)

    def score_weighted_value_cov(self) -> torch.Tensor:
        """C_V(h) = 1/N sum_t w_t v_t^T v_t with w normalised to mean 1 per head."""
        if self.wvv is None:
            raise ValueError("the score-weighted value pass has not run")
        return self.wvv / self.w_sum[:, None, None]

    def key_mean(self) -> torch.Tensor:
        self._need()
        return self.k_sum / self.num_tokens
