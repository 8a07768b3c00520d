"""OptR (docs/design.md §6, paper 001): refine each KV head's rotations against the post-W_O attention error.

R = R0 @ expm(A - A^T) per KV head, A = 0 at the start (so step 0 is the base rotation). The key
loss, over the last ``num_queries`` query positions of each calibration sequence with values in
full precision, is KL(p || p_K) + lambda_K * ||(p_K - p) V W_O,j^T||^2 / d_model; then, under the
chosen key rotation, the value loss is ||(p_K * quantized) (V~ - V) W_O,j^T||^2 / d_model. Query
position t reads key p quantized exactly when the cache would hold it in its history then:
S0 <= p < t - W. Rounding passes gradients straight through inside the clip range (STE).
Adam; the rotation kept for each head is the one with the lowest held-out loss among the checks
every ``eval_every`` steps (step 0 included, so a head never ends worse than its base rotation).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..quant import clip_threshold, fake_quantize
from ..spec import LayerSpec, OptRSpec

logger = logging.getLogger(__name__)


@dataclass
class LayerTraces:
    """What one layer saw on the calibration sequences (float32, CPU).

    q: [S, H_q, n, D] the last n queries; k, v: [S, H_kv, T, D]; w_o: [d_model, H_q * D].
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    w_o: torch.Tensor
    scale: float


def fake_quantize_ste(x: torch.Tensor, bits: int, group_size: int, clip_ratio: float, scale_dtype: str) -> torch.Tensor:
    """The reference quantizer's values, with gradient 1 inside the clip range and 0 outside."""
    tau = clip_threshold(x.detach(), clip_ratio) if clip_ratio < 1.0 else x.detach().abs().amax(-1, keepdim=True)
    clipped = torch.minimum(torch.maximum(x, -tau), tau)
    rounded = fake_quantize(clipped.detach(), bits, group_size, 1.0, scale_dtype)
    return clipped + (rounded - clipped).detach()


def _quantized_mask(T: int, n: int, sink: int, recent: int, device) -> torch.Tensor:
    """[n, T] bool: query position t (the last n of T) reads key p from the quantized history."""
    t = torch.arange(T - n, T, device=device)[:, None]
    p = torch.arange(T, device=device)[None, :]
    return (p >= sink) & (p < t - recent)


def _rotations(base: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return base @ torch.linalg.matrix_exp(a - a.transpose(-1, -2))


class _HeadLosses:
    """Per-KV-head losses of one layer on a set of sequences; every method returns [H_kv]."""

    def __init__(self, traces: LayerTraces, layer: LayerSpec, mean: torch.Tensor | None, lambda_k: float):
        self.t, self.layer, self.lambda_k = traces, layer, lambda_k
        S, H_q, n, D = traces.q.shape
        H_kv, T = traces.k.shape[1], traces.k.shape[2]
        self.g = H_q // H_kv
        self.mean = torch.zeros(H_kv, D) if mean is None else mean.float()
        kv = layer.kv_cache
        self.quantized = _quantized_mask(T, n, kv.sink_tokens, kv.recent_tokens, traces.q.device)  # [n, T]
        causal = torch.arange(T)[None, :] <= torch.arange(T - n, T)[:, None]
        self.neg = torch.where(causal, 0.0, float("-inf"))  # [n, T]
        w = traces.w_o.reshape(traces.w_o.shape[0], H_q, D).transpose(0, 1)  # [H_q, d_model, D]
        self.w_o = w.reshape(H_kv, self.g, *w.shape[1:])  # [H_kv, g, d_model, D]
        self.q = traces.q.reshape(S, H_kv, self.g, n, D)
        self.d_model = traces.w_o.shape[0]
        self.p = self._probs(traces.k)

    def _probs(self, keys: torch.Tensor, quant_keys: torch.Tensor | None = None) -> torch.Tensor:
        scores = torch.einsum("shgnd,shtd->shgnt", self.q, keys) * self.t.scale
        if quant_keys is not None:
            scores_q = torch.einsum("shgnd,shtd->shgnt", self.q, quant_keys) * self.t.scale
            scores = torch.where(self.quantized, scores_q, scores)
        return torch.softmax(scores + self.neg, dim=-1)

    def _readout_error(self, e: torch.Tensor) -> torch.Tensor:
        """e: [S, H_kv, g, n, D] attention-output error -> mean ||e W_O,j^T||^2 / d_model per KV head."""
        out = torch.einsum("shgnd,hgmd->shgnm", e, self.w_o)
        return out.pow(2).sum(-1).mean(dim=(0, 2, 3)) / self.d_model

    def quant_keys(self, rot_k: torch.Tensor) -> torch.Tensor:
        kv = self.layer.kv_cache
        x = torch.einsum("shtd,hde->shte", self.t.k - self.mean[None, :, None], rot_k)
        xq = fake_quantize_ste(x, kv.bits, kv.group_size, self.layer.key.clip_ratio, kv.scale_dtype)
        return torch.einsum("shte,hde->shtd", xq, rot_k) + self.mean[None, :, None]

    def key_loss(self, rot_k: torch.Tensor) -> torch.Tensor:
        p_k = self._probs(self.t.k, self.quant_keys(rot_k))
        kl = (self.p * (torch.log(self.p.clamp_min(1e-30)) - torch.log(p_k.clamp_min(1e-30)))).sum(-1)
        e = torch.einsum("shgnt,shtd->shgnd", p_k - self.p, self.t.v)
        return kl.mean(dim=(0, 2, 3)) + self.lambda_k * self._readout_error(e)

    def value_loss(self, rot_v: torch.Tensor, p_k: torch.Tensor) -> torch.Tensor:
        kv = self.layer.kv_cache
        x = torch.einsum("shtd,hde->shte", self.t.v, rot_v)
        xq = fake_quantize_ste(x, kv.bits, kv.group_size, self.layer.value.clip_ratio, kv.scale_dtype)
        dv = torch.einsum("shte,hde->shtd", xq, rot_v) - self.t.v
        e = torch.einsum("shgnt,shtd->shgnd", p_k * self.quantized, dv)
        return self._readout_error(e)


def _optimise(base: torch.Tensor, train_loss, heldout_loss, cfg: OptRSpec) -> torch.Tensor:
    """Adam on A (per head), keeping per head the rotation with the best held-out loss."""
    a = torch.zeros_like(base, requires_grad=True)
    opt = torch.optim.Adam([a], lr=cfg.lr)
    best = base.clone()
    with torch.no_grad():
        best_loss = heldout_loss(base)
    for step in range(1, cfg.steps + 1):
        opt.zero_grad()
        train_loss(_rotations(base, a)).sum().backward()
        opt.step()
        if step % cfg.eval_every == 0 or step == cfg.steps:
            with torch.no_grad():
                rot = _rotations(base, a)
                loss = heldout_loss(rot)
                better = loss < best_loss
                best[better], best_loss = rot[better], torch.where(better, loss, best_loss)
    return best


def refine_layer(traces: LayerTraces, layer: LayerSpec, base_k: torch.Tensor, base_v: torch.Tensor,
                 mean: torch.Tensor | None, cfg: OptRSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """OptR for one layer: (R_K, R_V) [H_kv, D, D], each refined when the spec asks for optr."""
    S = traces.q.shape[0]
    num_train = max(1, S - max(1, round(S * cfg.heldout_fraction))) if S > 1 else 1
    split = [slice(0, num_train), slice(num_train, S) if S > 1 else slice(0, S)]
    parts = [LayerTraces(traces.q[s], traces.k[s], traces.v[s], traces.w_o, traces.scale) for s in split]
    train, held = (_HeadLosses(p, layer, mean, cfg.lambda_k) for p in parts)
    rot_k, rot_v = base_k.float(), base_v.float()
    if layer.key.rotation == "optr":
        rot_k = _optimise(rot_k, train.key_loss, held.key_loss, cfg)
    if layer.value.rotation == "optr":
        with torch.no_grad():
            p_train = train._probs(train.t.k, train.quant_keys(rot_k))
            p_held = held._probs(held.t.k, held.quant_keys(rot_k))
        rot_v = _optimise(rot_v, lambda r: train.value_loss(r, p_train), lambda r: held.value_loss(r, p_held), cfg)
    return rot_k.detach(), rot_v.detach()
