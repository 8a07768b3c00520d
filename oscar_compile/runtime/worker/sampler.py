"""Turn a batch of next-token logits into tokens: logit controls, greedy, temperature, min-p,
top-k, top-p, seeds.

Sampling uses the exponential-race form of the categorical draw: ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. is a sample from ``p``. The noise is a pure function of (the request's seed,
the absolute position of the token being drawn, the token id): a counter-based hash
(``noise_key`` on the host mixes seed and position into a 64-bit row key; ``exponential_noise`` on
the device hashes the key with every token id in integer ops and maps the 32-bit result to
``E = -log1p(-u)``). So a request's tokens do not depend on the other rows of the batch, its row
index, the step count or any generator state: a preempted sequence (swapped or recomputed)
resumes at the same position with the same draws, and a discarded overlapped step consumes
nothing. Every request has a seed (``Sequence.seed``: its own, else ``default_seed``), so choice
``i`` of ``n`` can later draw with ``seed + i``. SGLang's deterministic mode does the same (a
murmur-style hash of seed, position and column, then Gumbel-max); we use the exponential race,
which is the same draw, in float32. The hash is the same on every device; ``log1p`` may differ by
an ulp between CPU and CUDA, so equal noise across devices is not promised, on one device it is.

Logprobs are those of the model's distribution (log-softmax of the raw logits, before the logit
controls of logits_controls.py (penalties, logit_bias, min_tokens), the grammar mask
(grammar_mask.py), temperature and filtering),
the convention of the OpenAI API and vLLM's default. The controls come in as a ``LogitsControls``
that is None when no request of the batch uses one, the bitmask likewise: that path runs exactly
what it ran without them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from oscar_compile.runtime.core.sampling_params import SamplingParams
from oscar_compile.runtime.worker.grammar_mask import apply_token_bitmask
from oscar_compile.runtime.worker.logits_controls import LogitsControls, TokenCache, apply_controls
from oscar_compile.runtime.worker.transfer import to_device

__all__ = ["DeviceSample", "SampleResult", "Sampler", "exponential_noise", "filtered_probs", "noise_key",
           "to_device"]

_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF


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
        self._result: SampleResult | None = None
        if token_ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self._host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensors

    def result(self) -> SampleResult:
        """The samples on the host (converted once: the engine may read them twice)."""
        if self._result is None:
            self._result = self._read()
        return self._result

    def _read(self) -> SampleResult:
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
        self.token_cache = TokenCache()  # the penalties' token copies (logits_controls.build_controls)

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's token copies (the noise keeps no state)."""
        self.token_cache.forget(seq_id)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 positions: list[int], controls: LogitsControls | None = None,
                 bitmask: torch.Tensor | None = None) -> SampleResult:
        return self.sample(logits, params, seeds, positions, controls, bitmask).result()

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               positions: list[int], controls: LogitsControls | None = None,
               bitmask: torch.Tensor | None = None) -> DeviceSample:
        """Draw one token per row, without waiting for the device. Row ``b`` draws with the noise
        of ``(seeds[b], positions[b])`` (the request's seed, the absolute position of the token
        drawn). ``controls`` (built by ``logits_controls.build_controls``) change the logits that
        are sampled, not the logprobs; so does ``bitmask`` (a grammar's allowed tokens, int32
        ``[B, ceil(V / 32)]`` on the host, pinned: copied without waiting; grammar_mask.py),
        applied after them."""
        # logits: [B, V] any float dtype; computed in float32
        logits = logits.float()
        controlled = logits
        if controls is not None:
            controlled = apply_controls(logits, controls)
        if bitmask is not None:
            controlled = apply_token_bitmask(controlled, bitmask.to(logits.device, non_blocking=True))
        token_ids = controlled.argmax(dim=-1)
        # the rows that draw, decided on the host (no copy, no sync); the filtering and the
        # [B, V] noise run on those rows only: every step of them is row-wise
        drawn = [b for b, p in enumerate(params) if not p.is_greedy]
        if drawn:
            rows = None if len(drawn) == len(params) else to_device(drawn, torch.int64, logits.device)
            sub = controlled if rows is None else controlled.index_select(0, rows)
            probs = filtered_probs(sub, [params[b] for b in drawn])
            keys = to_device([noise_key(seeds[b], positions[b]) for b in drawn], torch.int64, logits.device)
            sampled = (probs / exponential_noise(keys, probs.shape[-1])).argmax(dim=-1)
            token_ids = sampled if rows is None else token_ids.index_copy(0, rows, sampled)
        wanted = [p.logprobs for p in params]
        if all(k is None for k in wanted):
            return DeviceSample(token_ids, wanted)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        max_k = max(k or 0 for k in wanted)
        top = logprobs.topk(max_k, dim=-1) if max_k else None
        return DeviceSample(token_ids, wanted, chosen, (top.values, top.indices) if top else None)


def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer (Steele, Lea, Flood 2014): a bijection of 64-bit ints whose
    output bits each depend on every input bit."""
    x = (x + 0x9E37_79B9_7F4A_7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int) -> int:
    """The 64-bit key of one draw (host side, plain ints): mixes the request's seed (any int;
    taken mod 2^64) and the absolute position of the token drawn. Returned as a signed int64 so
    that it fits a torch tensor."""
    key = _splitmix64(_splitmix64(seed & _M64) ^ (position & _M64))
    return key - (1 << 64) if key >= 1 << 63 else key


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x = x * c mod 2^32`` in place, for ``x`` in [0, 2^32) held in int64, with no int64
    overflow (signed overflow is undefined in the C++ kernels): ``c`` is split into 16-bit halves."""
    high = (x * (c >> 16)).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(high).bitwise_and_(_M32)


def _fmix32_(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer, in place, on int64 values in [0, 2^32)."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x85EB_CA6B)
    x.bitwise_xor_(x >> 13)
    _mul32_(x, 0xC2B2_AE35)
    return x.bitwise_xor_(x >> 16)


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise ``[B, V]`` float32, entry ``(b, v)`` a pure function of ``(keys[b], v)``.

    ``h = fmix32(v * m + a mod 2^32)``, MurmurHash3's finalizer over a keyed affine map of the
    token id: ``a`` is the key's low half, ``m`` its high half made odd (so the map is a bijection
    and two keys give no shifted copies of one noise row, as ``v + a`` alone would). The 32 bits
    give ``u = (h + 1/2) / 2^32`` in (0, 1) and ``E = -log1p(-u)``: ``log1p`` keeps the small
    ``E`` (the ones that let an unlikely token win) exact down to 2^-33; ``u`` is capped below 1
    so ``E`` stays finite (at most 16.6: a tail of probability 6e-8 is folded onto the cap).
    Needs ``V < 2^31`` (then ``v * m`` fits int64).

    Cost: about 20 elementwise int64 passes over ``[B, V]``, against one for a batch-wide
    ``exponential_``. On the CPU (V = 151,936, 2 shared cores) that measured 1-2.5x its time
    (B = 1: 4 ms both; B = 32: 0.5 s against 0.2-0.25 s). Not measured on a GPU yet, where it is
    bandwidth-bound (~1.3 GB moved at B = 32, ~0.4 ms on an H200): fusing it into one kernel
    (``torch.compile`` or Triton) would bring it back to one pass."""
    # keys: [B] int64
    k = keys[:, None]
    a, m = k & _M32, ((k >> 32) & _M32) | 1
    h = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :] * m  # [B, V] int64
    _fmix32_(h.add_(a).bitwise_and_(_M32))
    u = h.float().add_(0.5).mul_(2.0**-32).clamp_max_(1.0 - 2.0**-24)
    return u.neg_().log1p_().neg_()


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
