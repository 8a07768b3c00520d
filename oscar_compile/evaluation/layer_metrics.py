"""Per-layer fidelity (docs/design.md §7) on held-out text, every method against BF16 in one pass.

Setting: teacher-forced decoding of a held-out window of T tokens (every token goes through the
cache: ``starts[t] = t``), scored at the last Q query positions, where the quantized history is
longest. Two kinds of numbers:

* **isolated** (one layer's cache quantized, its inputs from the BF16 run): computed inside one
  BF16 forward per batch, for all methods at once, from that layer's q, k, v:
  - K / V relative MSE ``sum ||k~ - k||^2 / sum ||k||^2`` over the keys (values) the last query
    reads quantized, original coordinates (rotations preserve norms; centring is undone);
  - QK^T MSE: mean squared error of the attention logits ``q . k * scaling`` over the (query,
    key) pairs read quantized;
  - attention KL(p_bf16 || p_q) in nats, averaged over query heads and scored positions;
  - post-W_O error: ``sum ||(o~ - o) W_O^T||^2 / sum ||o W_O^T + b||^2`` (relative).
* **propagated**: all layers quantized, a second forward per method; each decoder layer's output
  hidden state against BF16's, ``sum ||h~ - h||^2 / sum ||h||^2`` at the scored positions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..architectures import attention_modules
from .quantizers import LayerQuantizer, cache_starts
from .simulate import _repeat_kv, attention_override, capture_hidden, simulated_layer

# each metric as a ratio of two running sums, by the names ``LayerSums.add`` takes
RATIOS = {"k_rel_mse": ("k_err", "k_ref"), "v_rel_mse": ("v_err", "v_ref"), "qk_mse": ("qk_sq", "qk_n"),
          "attn_kl": ("kl", "kl_n"), "attn_out_rel_err": ("o_err", "o_ref"), "hidden_rel_err": ("h_err", "h_ref")}
METRICS = tuple(RATIOS)
METRIC_TITLES = {  # how the report and the plots title each metric
    "k_rel_mse": "K relative MSE", "v_rel_mse": "V relative MSE", "qk_mse": "QK^T (logit) MSE",
    "attn_kl": "attention KL(p_bf16 || p_q), nats", "attn_out_rel_err": "attention output after W_O, relative error",
    "hidden_rel_err": "propagated hidden state, relative error (all layers quantized)",
}


@dataclass
class LayerSums:
    """Running numerators and denominators of one (method, layer), by their names in ``RATIOS``;
    float64 on the host."""

    sums: dict[str, float] = field(default_factory=lambda: {name: 0.0 for pair in RATIOS.values() for name in pair})

    def add(self, **values: torch.Tensor) -> None:
        for name, value in values.items():
            self.sums[name] += float(value)  # a name outside RATIOS: KeyError

    def result(self) -> dict[str, float]:
        """Each metric's ratio; 0 where nothing was read quantized (a zero denominator)."""
        return {metric: self.sums[num] / self.sums[den] if self.sums[den] else 0.0
                for metric, (num, den) in RATIOS.items()}


def _isolated(sums: LayerSums, quantizer: LayerQuantizer, o_proj: nn.Linear, q, k, v, scaling: float,
              starts: torch.Tensor, num_scored: int) -> None:
    """Accumulate one layer's isolated metrics. q: [B, H_q, T, D]; k, v: [B, H_kv, T, D]; starts: [1, T]."""
    B, H, T, D = q.shape
    k_q, v_q = quantizer.fake_quantize(k, v)  # float32
    k, v = k.float(), v.float()
    mk, mv = quantizer.bounds(starts[:, T - num_scored:]).masks(T)  # [1, Q, T]
    last_k, last_v = mk[:, -1, None, :, None], mv[:, -1, None, :, None]  # [1, 1, T, 1]
    sums.add(k_err=((k_q - k).square() * last_k).sum(), k_ref=(k.square() * last_k).sum(),
             v_err=((v_q - v).square() * last_v).sum(), v_ref=(v.square() * last_v).sum())
    qs = q[:, :, T - num_scored:].float()  # [B, H_q, Q, D]
    kr, kq = _repeat_kv(k, H), _repeat_kv(k_q, H)
    t = torch.arange(T - num_scored, T, device=q.device)[:, None]
    future = torch.arange(T, device=q.device)[None, :] > t  # [Q, T]
    s = (qs @ kr.transpose(-1, -2) * scaling).masked_fill(future, float("-inf"))  # [B, H_q, Q, T]
    s_q = torch.where(mk[:, None], qs @ kq.transpose(-1, -2) * scaling, s)
    diff = torch.where(mk[:, None], s_q - s, torch.zeros_like(s))
    sums.add(qk_sq=diff.square().sum(), qk_n=mk.sum() * B * H)
    logp, logp_q = s.log_softmax(-1), s_q.log_softmax(-1)
    p, p_q = logp.exp(), logp_q.exp()
    kl = torch.where(future, torch.zeros_like(s), p * (logp - logp_q))
    sums.add(kl=kl.sum(), kl_n=B * H * num_scored)
    vr, vq = _repeat_kv(v, H), _repeat_kv(v_q, H)
    mvh = mv[:, None].float()
    o = p @ vr  # [B, H_q, Q, D]
    o_q = (p_q * (1 - mvh)) @ vr + (p_q * mvh) @ vq
    w = o_proj.weight.float()
    b = None if o_proj.bias is None else o_proj.bias.float()
    y = F.linear(o.transpose(1, 2).reshape(B, num_scored, H * D), w, b)
    y_q = F.linear(o_q.transpose(1, 2).reshape(B, num_scored, H * D), w, b)
    sums.add(o_err=(y_q - y).square().sum(), o_ref=y.square().sum())


class LayerMetrics:
    """Accumulates the per-layer metrics of several methods over batches of held-out windows."""

    def __init__(self, model: nn.Module, methods: dict[str, Sequence[LayerQuantizer | None]], num_scored: int):
        self.model, self.methods, self.num_scored = model, methods, num_scored
        self.num_layers = len(attention_modules(model))
        self.sums = {name: [LayerSums() for _ in range(self.num_layers)] for name in methods}

    def _isolated_layer(self, i: int, o_proj: nn.Linear, starts: torch.Tensor):
        def attend(q, k, v, scaling, run_inner):
            for name, quantizers in self.methods.items():
                if quantizers[i] is not None:
                    _isolated(self.sums[name][i], quantizers[i], o_proj, q, k, v, scaling, starts, self.num_scored)
            return run_inner()

        return attend

    def add_batch(self, input_ids: torch.Tensor) -> None:
        """input_ids: [B, T] held-out windows (T > num_scored)."""
        T = input_ids.shape[1]
        if T <= self.num_scored:
            raise ValueError(f"metric windows of {T} tokens cannot score the last {self.num_scored}")
        starts = cache_starts(T, device=input_ids.device)
        positions = torch.arange(T - self.num_scored, T, device=input_ids.device)
        ref: list[torch.Tensor] = []
        o_projs = [m.o_proj for m in attention_modules(self.model)]
        per_layer = [self._isolated_layer(i, o_projs[i], starts) for i in range(self.num_layers)]
        with attention_override(self.model, per_layer), capture_hidden(self.model, positions, ref):
            self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        for name, quantizers in self.methods.items():
            if all(qz is None for qz in quantizers):
                continue  # the BF16 forward itself: zero error by construction
            hidden: list[torch.Tensor] = []
            sim = [simulated_layer(qz, starts) for qz in quantizers]
            with attention_override(self.model, sim), capture_hidden(self.model, positions, hidden):
                self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
            for sums, h, h_ref in zip(self.sums[name], hidden, ref, strict=True):
                sums.add(h_err=(h - h_ref).square().sum(), h_ref=h_ref.square().sum())

    def results(self) -> dict[str, list[dict[str, float]]]:
        """{method: [{"layer": i, metric: value, ...} per layer]}."""
        return {name: [{"layer": i, **s.result()} for i, s in enumerate(layers)] for name, layers in self.sums.items()}

