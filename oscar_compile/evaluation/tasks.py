"""End-task metrics on held-out windows: perplexity and greedy-token agreement with BF16.

Both follow how the compressed cache is used: the context is prefilled in one chunk (under the
decode-consistent prefill semantics, the default, as decode steps read it; under prompt-exact,
in full precision within the chunk), then the continuation goes through decode steps that read the quantized history
(quantizers.cache_starts). A "context length" C is the whole window:
``C - M`` prefilled tokens and ``M`` scored ones, so every position stays inside the model's
trained range.

* perplexity: exp of the mean next-token NLL of the M continuation tokens (``ppl_tokens``);
* agreement: BF16 greedily generates N tokens after a ``C - N``-token prompt (HF ``generate``
  with its own cache); each method is teacher-forced on them and scores the share of steps where
  its argmax is BF16's token, and the matched prefix (steps before its first disagreement, which
  equals free-running greedy agreement: up to there both decode the same tokens).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..formats.prefill import DEFAULT_PREFILL_SEMANTICS
from .quantizers import LayerQuantizer, cache_starts
from .simulate import simulated_logits

Quantizers = Sequence[LayerQuantizer | None]


def batches(windows: torch.Tensor, batch_size: int, progress: bool, desc: str) -> Iterator[torch.Tensor]:
    """Split [n, T] into [<= batch_size, T] chunks, with a progress bar when asked (CLI only)."""
    chunks = list(windows.split(batch_size))
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc=desc, unit="batch", leave=False)
    yield from chunks


def perplexity(model: nn.Module, methods: dict[str, Quantizers], windows: torch.Tensor, ppl_tokens: int,
               batch_size: int, progress: bool = False, semantics: str = DEFAULT_PREFILL_SEMANTICS) -> dict[str, dict]:
    """windows: [n, C] token ids -> {method: {"ppl", "nll", "tokens", "nll_se", "window_nll"}} over the
    last ``ppl_tokens`` of each. ``window_nll``: each window's mean NLL, in window order (two runs
    on the same windows compare pairwise); ``nll_se``: the standard error of ``nll`` over windows.
    ``semantics``: the prefill semantics the context is prefilled under (formats/prefill.py)."""
    C = windows.shape[1]
    if not 0 < ppl_tokens < C:
        raise ValueError(f"ppl_tokens ({ppl_tokens}) must be between 1 and the context length - 1 ({C - 1})")
    device = next(model.parameters()).device
    starts = cache_starts(C, prefill=C - ppl_tokens, device=device, semantics=semantics)
    per_window: dict[str, list[float]] = {name: [] for name in methods}
    for ids in batches(windows, batch_size, progress, f"perplexity @{C}"):
        ids = ids.to(device)
        targets = ids[:, C - ppl_tokens:]  # [B, M]
        for name, quantizers in methods.items():
            logits = simulated_logits(model, quantizers, ids, starts, logits_to_keep=ppl_tokens + 1,
                                      label=name)[:, :-1]
            token_nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, M]
            per_window[name] += token_nll.double().mean(dim=1).tolist()
    out = {}
    for name, values in per_window.items():
        n = len(values)
        mean = sum(values) / n
        se = math.sqrt(sum((x - mean) ** 2 for x in values) / (n - 1) / n) if n > 1 else float("nan")
        out[name] = {"ppl": math.exp(mean), "nll": mean, "tokens": n * ppl_tokens, "nll_se": se,
                     "window_nll": values}
    return out


def greedy_reference(model: nn.Module, prompts: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """BF16 greedy continuation [B, N] of prompts [B, P] with HF generate (EOS suppressed for N steps)."""
    pad = model.config.pad_token_id
    pad = pad if pad is not None else (model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0)
    with _quiet_generation_config(model):
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens, pad_token_id=pad)
    return out[:, prompts.shape[1]:]


@contextlib.contextmanager
def _quiet_generation_config(model: nn.Module) -> Iterator[None]:
    """Greedy decoding ignores sampling knobs; clear them so generate() does not warn about each."""
    cfg = getattr(model, "generation_config", None)
    saved = {k: getattr(cfg, k, None) for k in ("temperature", "top_p", "top_k")} if cfg is not None else {}
    try:
        for k in saved:
            setattr(cfg, k, None)
        yield
    finally:
        for k, v in saved.items():
            setattr(cfg, k, v)


def agreement(model: nn.Module, methods: dict[str, Quantizers], windows: torch.Tensor, gen_tokens: int,
              batch_size: int, progress: bool = False, semantics: str = DEFAULT_PREFILL_SEMANTICS) -> dict[str, dict]:
    """windows: [n, C]; the first C - N tokens are the prompt -> {method: {"agreement", "prefix"}} in [0, 1]."""
    C = windows.shape[1]
    N = gen_tokens
    if not 0 < N < C:
        raise ValueError(f"gen_tokens ({N}) must be between 1 and the context length - 1 ({C - 1})")
    device = next(model.parameters()).device
    starts = cache_starts(C - 1, prefill=C - N, device=device, semantics=semantics)
    match = {name: 0.0 for name in methods}
    prefix = {name: 0.0 for name in methods}
    rows = 0
    for ids in batches(windows, batch_size, progress, f"agreement @{C}"):
        prompt = ids[:, : C - N].to(device)
        ref = greedy_reference(model, prompt, N)  # [B, N]
        seq = torch.cat([prompt, ref], dim=1)[:, :-1]  # [B, C - 1]: the last token is never fed back
        for name, quantizers in methods.items():
            pred = simulated_logits(model, quantizers, seq, starts, logits_to_keep=N, label=name).argmax(-1)  # [B, N]
            same = pred == ref
            match[name] += float(same.float().mean(dim=1).sum())
            prefix[name] += float(same.long().cumprod(dim=1).sum(dim=1).float().div(N).sum())
        rows += ids.shape[0]
    return {name: {"agreement": match[name] / rows, "prefix": prefix[name] / rows, "tokens": N, "prompts": rows}
            for name in methods}
