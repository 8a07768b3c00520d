"""Turn a batch of next-token logits into tokens: logit controls, greedy, temperature, min-p,
top-k, top-p, seeds.

Sampling uses the exponential-race form of the categorical draw: ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. is a sample from ``p``. The noise row of a seeded request comes from its own
``torch.Generator``, so its tokens depend only on its seed and its logits, not on what else
shares the batch or on preemption (a row is drawn only when a token is really sampled).

Logprobs are those of the model's distribution (log-softmax of the raw logits, before the logit
controls of logits_controls.py (penalties, logit_bias, min_tokens), temperature and filtering),
the convention of the OpenAI API and vLLM's default. The controls come in as a ``LogitsControls``
that is None when no request of the batch uses one: that path runs exactly what it ran without them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.worker.logits_controls import LogitsControls, TokenCache, apply_controls
from oscar_compile.runtime.worker.transfer import to_device

__all__ = ["DeviceSample", "SampleResult", "Sampler", "filtered_probs", "to_device"]


@dataclass
class SampleResult:
    """Plain Python results: one entry per row."""

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


class DeviceSample:
    """A step's samples on their way to the host: the tensors stay where the logits were, their
    copies into pinned host memory are queued on the stream at once (so reading them later waits
    for this step only, not for whatever was queued after it), ``result`` waits and converts."""

    def __init__(self, token_ids: torch.Tensor, wanted: list[int | None],
                 chosen: torch.Tensor | None = None, top: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.token_ids = token_ids  # [B] int64, on the logits' device (the next step may read it there)
        self.wanted = wanted
        tensors = [token_ids] + ([chosen] if chosen is not None else []) + (list(top) if top else [])
        self._event = None
        if token_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self._host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def result(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        ids = self._host[0].tolist()
        if all(k is None for k in self.wanted):
            return SampleResult(ids, [None] * len(ids), [None] * len(ids))
        chosen = self._host[1].tolist()
        top_vals, top_ids = (self._host[2], self._host[3]) if len(self._host) > 2 else (None, None)
        out_lp: list[float | None] = []
        out_top: list[list[tuple[int, float]] | None] = []
        for row, k in enumerate(self.wanted):
            out_lp.append(None if k is None else chosen[row])
            if not k:
                out_top.append(None if k is None else [])
                continue
            out_top.append(list(zip(top_ids[row, :k].tolist(), top_vals[row, :k].tolist(), strict=True)))
        return SampleResult(ids, out_lp, out_top)


class Sampler:
    def __init__(self):
        self._generators: dict[int, torch.Generator] = {}
        self.token_cache = TokenCache()  # the penalties' token copies (logits_controls.build_controls)

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's generator and token copies."""
        self._generators.pop(seq_id, None)
        self.token_cache.forget(seq_id)

    def _generator(self, seq_id: int, seed: int, device: torch.device) -> torch.Generator:
        gen = self._generators.get(seq_id)
        if gen is None or gen.device != device:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._generators[seq_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 seq_ids: list[int], controls: LogitsControls | None = None) -> SampleResult:
        return self.sample(logits, params, seq_ids, controls).result()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               seq_ids: list[int], controls: LogitsControls | None = None) -> DeviceSample:
        """Draw one token per row, without waiting for the device. ``controls`` (built by
        ``logits_controls.build_controls``) change the logits that are sampled, not the logprobs."""
        # logits: [B, V] any float dtype; computed in float32
        logits = logits.float()
        controlled = logits
        if controls is not None:
            controlled = apply_controls(logits, controls)
        token_ids = controlled.argmax(dim=-1)
        if not all(p.is_greedy for p in params):  # decided on the host: no copy, no sync
            greedy = to_device([p.is_greedy for p in params], torch.bool, logits.device)
            probs = filtered_probs(controlled, params)
            noise = self._noise(probs, params, seq_ids)
            sampled = (probs / noise).argmax(dim=-1)
            token_ids = torch.where(greedy, token_ids, sampled)
        wanted = [p.logprobs for p in params]
        if all(k is None for k in wanted):
            return DeviceSample(token_ids, wanted)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        max_k = max(k or 0 for k in wanted)
        top = logprobs.topk(max_k, dim=-1) if max_k else None
        return DeviceSample(token_ids, wanted, chosen, (top.values, top.indices) if top else None)

    def _noise(self, probs: torch.Tensor, params: list[SamplingParams],
               seq_ids: list[int]) -> torch.Tensor:
        noise = torch.empty_like(probs).exponential_()
        for row, (p, seq_id) in enumerate(zip(params, seq_ids, strict=True)):
            if p.seed is not None and not p.is_greedy:
                gen = self._generator(seq_id, p.seed, probs.device)
                noise[row].exponential_(generator=gen)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of ``logits / T`` after min-p, top-k and top-p; rows of greedy requests use T = 1.

    min-p (vLLM's and transformers' ``MinPLogitsWarper``): a token whose probability after the
    temperature is below ``min_p`` times the top token's is dropped."""
    # logits: [B, V] float32
    B, V = logits.shape
    device = logits.device
    temps = to_device([1.0 if p.is_greedy else p.temperature for p in params], torch.float32, device)
    logits = logits / temps[:, None]
    if any(p.min_p > 0.0 for p in params):
        min_ps = to_device([p.min_p for p in params], torch.float32, device)
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_ps[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    top_ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    if any(k < V for k in top_ks):
        k_tensor = to_device(top_ks, torch.int64, device)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (k_tensor - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1.0 for p in params):
        top_ps = to_device([p.top_p for p in params], torch.float32, device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token if the mass strictly before it is < top_p (the top token is always kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_ps[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
