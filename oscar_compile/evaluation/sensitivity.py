"""Per-layer sensitivity: how far the continuation moves from BF16 as one layer is stored otherwise.

The measure is the KL divergence of the next-token distribution to BF16's,
``KL(p_bf16 || p_q)`` in nats, averaged over the scored continuation tokens of held-out windows
(the perplexity task's schedule: the context prefilled in one chunk, the continuation decoded
over the compressed history; tasks.py). Why KL and not perplexity:

* it compares with the BF16 model token by token over the whole vocabulary, so it is zero
  exactly when the compressed cache changes nothing, and never negative; a perplexity delta
  mixes in whether the change happened to help on these tokens, and the single-layer deltas
  this sweep needs (a tenth of a percent) are within the noise of a few windows of perplexity;
* it is the quantity the deltas can be added over: for small perturbations it is a quadratic
  form of the logit error, and errors of different layers' caches add nearly independently.
  The sweep checks that on the chosen spec (predicted against measured KL, sweep.py).

Perplexity (the continuation's NLL) is recorded beside it for every probe, to read, not to
decide. A *probe* is a full list of per-layer quantizers; the sweep's probes are the base spec
and the base spec with one layer stored in another format (leave-one-layer-at-higher-precision).
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch
from torch import nn

from ..architectures import attention_modules
from .quantizers import LayerQuantizer, cache_starts
from .simulate import simulated_logits

Probe = Sequence[LayerQuantizer | None]


def _kl_and_nll(ref_logp: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """Summed KL(p_ref || p) and NLL over the tokens. ref_logp, logits: [B, M, V]; targets: [B, M]."""
    logp = logits.float().log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [B, M]
    nll = -logp.gather(-1, targets[..., None])[..., 0]
    return float(kl.double().sum()), float(nll.double().sum())


def reference_logprobs(model: nn.Module, windows: torch.Tensor, scored_tokens: int,
                       batch_size: int) -> list[torch.Tensor]:
    """BF16's log-probabilities of the scored continuation, one [B, M, V] float32 tensor per batch.

    Kept by the sweep so that measuring the chosen spec at each budget costs one forward per
    batch, not two. windows: [n, C] token ids. Held on the model's device: n * M * V * 4 bytes
    (8 windows of 256 scored tokens: 67 MB for the bundled 8k vocabulary, 1.2 GB for Qwen3's 152k).
    """
    C = windows.shape[1]
    if not 0 < scored_tokens < C:
        raise ValueError(f"scored tokens ({scored_tokens}) must be between 1 and the context length - 1 ({C - 1})")
    device = next(model.parameters()).device
    starts = cache_starts(C, prefill=C - scored_tokens, device=device)
    num_layers = len(attention_modules(model))
    out = []
    with torch.inference_mode():
        for ids in windows.split(batch_size):
            ref = simulated_logits(model, [None] * num_layers, ids.to(device), starts, logits_to_keep=scored_tokens + 1)
            out.append(ref[:, :-1].log_softmax(-1))
    return out


def reference_nll(reference: Sequence[torch.Tensor], windows: torch.Tensor, batch_size: int) -> float:
    """BF16's mean NLL of the scored continuation, from :func:`reference_logprobs` (no forward)."""
    total, count = 0.0, 0
    for ids, ref_logp in zip(windows.split(batch_size), reference, strict=True):
        targets = ids[:, ids.shape[1] - ref_logp.shape[1]:].to(ref_logp.device)  # [B, M]
        total += float(-ref_logp.gather(-1, targets[..., None]).double().sum())
        count += targets.numel()
    return total / count


def continuation_divergence(model: nn.Module, probes: Mapping[Hashable, Probe], windows: torch.Tensor,
                            reference: Sequence[torch.Tensor], scored_tokens: int, batch_size: int,
                            progress: bool = False, desc: str = "sensitivity") -> dict[Hashable, dict[str, float]]:
    """{probe key: {"kl", "nll", "tokens"}}: mean KL to BF16 and NLL over the last ``scored_tokens``.

    windows: [n, C] token ids; reference: :func:`reference_logprobs` of the same windows and
    batch size. Every probe runs on the same windows, one batch at a time. Deterministic.
    """
    C = windows.shape[1]
    device = next(model.parameters()).device
    starts = cache_starts(C, prefill=C - scored_tokens, device=device)
    sums = {key: [0.0, 0.0] for key in probes}
    chunks = list(windows.split(batch_size))
    if len(reference) != len(chunks):
        raise ValueError(f"{len(reference)} reference batches for {len(chunks)} batches of windows")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chunks) * len(probes), desc=desc, unit="forward")
    count = 0
    with torch.inference_mode():
        for ids, ref_logp in zip(chunks, reference, strict=True):
            ids = ids.to(device)
            targets = ids[:, C - scored_tokens:]  # [B, M]
            for key, probe in probes.items():
                logits = simulated_logits(model, probe, ids, starts, logits_to_keep=scored_tokens + 1,
                                          label=str(key))[:, :-1]
                kl, nll = _kl_and_nll(ref_logp, logits, targets)
                sums[key][0] += kl
                sums[key][1] += nll
                if bar is not None:
                    bar.update(1)
            count += targets.numel()
    if bar is not None:
        bar.close()
    return {key: {"kl": kl / count, "nll": nll / count, "tokens": count} for key, (kl, nll) in sums.items()}


def tail_windows(tokens: torch.Tensor, length: int, num: int, bos: int | None) -> torch.Tensor:
    """[n, length] non-overlapping windows from the *end* of ``tokens`` (BOS first when the model has one).

    ``oscar-compile eval`` scores windows from the start of the held-out file, so a sweep that
    tunes on the end of it is not tuned on the eval's own windows (when the file holds both).
    """
    from .heldout import heldout_windows

    body = length - (bos is not None)
    n = min(num, len(tokens) // body)
    return heldout_windows(tokens[len(tokens) - max(n, 1) * body:], length, num, bos)


__all__ = ["Probe", "continuation_divergence", "reference_logprobs", "reference_nll", "tail_windows"]
