"""Needle-in-a-haystack retrieval by context length and needle depth, every method on the same prompts.

Prompts come from ``oscar_compile.data.needle`` (plain layout: the model's BOS when it has one
(the id the perplexity windows start with, heldout.bos_id), held-out haystack with one
"special magic number" fact at a chosen depth, then the question), built on the held-out tokens.
A method retrieves correctly when its greedy answer reproduces every answer token (teacher-forced
argmax, which equals greedy decoding over the answer span).

Schedule (``mode``):
* ``context`` (default): the haystack is cached first, the question then runs as one chunk over
  the cache and the answer is decoded. The question must find the needle in the compressed
  history: the case of a long document cached once (prefix cache, multi-turn chat) and queried.
* ``prompt``: the whole prompt is prefilled at once (what one ``generate()`` call does); only the
  answer tokens after the first read the quantized history, so this mode barely separates methods.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data.needle import PLAIN_QUESTION, TOKENIZER_BOS, NeedleSample, TokenAdapter, make_needle_sample
from ..formats.prefill import DEFAULT_PREFILL_SEMANTICS
from .names import NEEDLE_MODES
from .quantizers import cache_starts
from .simulate import simulated_logits
from .tasks import Quantizers

logger = logging.getLogger(__name__)
MODES = NEEDLE_MODES


@dataclass
class NeedleCase:
    sample: NeedleSample
    depth: float  # the requested depth (cell key); sample.depth is the realised one
    question_len: int  # tokens of the question tail after the haystack


def needle_cases(tokenizer, haystack: Sequence[int], lengths: Sequence[int], depths: Sequence[float],
                 per_cell: int, seed: int = 0, bos: Any = TOKENIZER_BOS) -> list[NeedleCase]:
    """``per_cell`` plain-layout prompts per (length, depth), deterministic in ``seed``.

    The prompts start with ``bos`` (the model's BOS id; default the tokenizer's), or with the
    haystack when it is None.
    Lengths too short for the layout are skipped with a warning.
    """
    tk = TokenAdapter(tokenizer, bos)
    cases = []
    for li, length in enumerate(lengths):
        try:
            for di, depth in enumerate(depths):
                for k in range(per_cell):
                    s = (seed * 1_000_003 + li * 10_007 + di * 101 + k) & 0x7FFFFFFF
                    sample = make_needle_sample(tokenizer, haystack, length, depth=depth, seed=s,
                                                with_text=False, tok=tk)
                    tail = tk.encode(PLAIN_QUESTION.format(key=sample.key))
                    if sample.input_ids[-len(tail):] != tail:
                        raise RuntimeError("the needle prompt no longer ends with its question: update needle_task.py")
                    cases.append(NeedleCase(sample, float(depth), len(tail)))
        except ValueError as err:
            logger.warning("needle length %d skipped: %s", length, err)
            cases = [c for c in cases if c.sample.length != length]
    return cases


def _batch(cases: list[NeedleCase], mode: str, pad: int, device,
           semantics: str = DEFAULT_PREFILL_SEMANTICS) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [B, T] rows (prompt + answer[:-1]) and their cache schedule [B, T]."""
    rows = [c.sample.input_ids + c.sample.answer_ids[:-1] for c in cases]
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), pad, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
    lengths = torch.tensor([c.sample.length for c in cases])
    if mode == "context":
        question = torch.tensor([c.question_len for c in cases])
        starts = cache_starts(T, prefill=lengths - question, chunk=question, semantics=semantics)
    else:
        starts = cache_starts(T, prefill=lengths, semantics=semantics)
    return ids.to(device), starts.to(device)


def _correct(logits: torch.Tensor, cases: list[NeedleCase], first: int) -> list[bool]:
    """logits: [B, K, V] for positions first.. ; row r is right iff its answer tokens are the argmax."""
    pred = logits.argmax(-1).tolist()
    out = []
    for row, c in zip(pred, cases, strict=True):
        a, offset = c.sample.answer_ids, c.sample.length - 1 - first
        out.append(row[offset : offset + len(a)] == list(a))
    return out


def needle_accuracy(model: nn.Module, methods: dict[str, Quantizers], cases: list[NeedleCase], mode: str = "context",
                    batch_size: int = 8, pad: int = 0, progress: bool = False,
                    semantics: str = DEFAULT_PREFILL_SEMANTICS) -> dict[str, list[dict]]:
    """{method: [{"length", "depth", "correct", "total"} per cell]}; prompts of one length share a batch.
    ``semantics``: the prefill semantics (formats/prefill.py); under ``decode-consistent`` both
    modes read the cache as decode steps do, so they give the same cells."""
    if mode not in MODES:
        raise ValueError(f"needle mode must be one of {MODES}, got {mode!r}")
    device = next(model.parameters()).device
    cells: dict[str, dict[tuple[int, float], list[int]]] = {name: {} for name in methods}
    groups = [[c for c in cases if c.sample.length == L] for L in sorted({c.sample.length for c in cases})]
    chunks = [g[i : i + batch_size] for g in groups for i in range(0, len(g), batch_size)]
    if progress:
        from tqdm.auto import tqdm

        chunks = tqdm(chunks, desc="needle", unit="batch", leave=False)
    for chunk in chunks:
        ids, starts = _batch(chunk, mode, pad, device, semantics)
        first = chunk[0].sample.length - 1  # one length per batch: logits from the last prompt position on
        for name, quantizers in methods.items():
            logits = simulated_logits(model, quantizers, ids, starts, logits_to_keep=ids.shape[1] - first,
                                      label=name)
            for c, ok in zip(chunk, _correct(logits, chunk, first), strict=True):
                cell = cells[name].setdefault((c.sample.length, c.depth), [0, 0])
                cell[0] += ok
                cell[1] += 1
    return {name: [{"length": L, "depth": d, "correct": n_ok, "total": n}
                   for (L, d), (n_ok, n) in sorted(by_cell.items())] for name, by_cell in cells.items()}


def accuracy_by_length(cells: list[dict]) -> dict[int, float]:
    """Collapse the depth axis: {length: accuracy}."""
    totals: dict[int, list[int]] = {}
    for c in cells:
        t = totals.setdefault(c["length"], [0, 0])
        t[0] += c["correct"]
        t[1] += c["total"]
    return {L: ok / n for L, (ok, n) in sorted(totals.items()) if n}


def pad_id(tokenizer, model) -> int:
    for cand in (getattr(tokenizer, "pad_token_id", None), model.config.pad_token_id,
                 getattr(tokenizer, "eos_token_id", None)):
        if isinstance(cand, int):
            return cand
    return 0


__all__ = ["NeedleCase", "needle_cases", "needle_accuracy", "accuracy_by_length", "pad_id", "MODES"]
