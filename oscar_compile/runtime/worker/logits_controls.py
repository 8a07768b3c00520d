"""The logit controls of a batch, on the device: logit_bias, min_tokens and the three penalties.

vLLM's semantics and order: ``logit_bias`` and ``min_tokens`` first, then the repetition
penalty (prompt and output tokens: a positive logit is divided by it, a negative one multiplied),
then OpenAI's presence and frequency penalties (output tokens only: ``logit -= presence *
(count > 0) + frequency * count``). Temperature, min_p, top-k and top-p follow in the sampler.

Only the rows that use a control are gathered and changed, in one vectorised pass. A batch in
which no request uses one pays nothing: ``build_controls`` returns None after one look at the
params (the same host check the sampler makes for greediness), and the sampler then launches
nothing more than before.

The output counts are rebuilt on the device each step from the tokens the engine keeps
(``Sequence.token_ids``, so they are right after a recompute preemption), plus the token still
pending on the device (overlapped stepping: the previous step's sample, not yet read by the
host), taken from the previous step's token tensor without a sync. ``TokenCache`` keeps device
copies of those tokens between steps, so the host copies only a step's new tokens, not a long
prompt every step.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from oscar_compile.runtime.core.sequence import Sequence
from oscar_compile.runtime.worker.transfer import to_device


@dataclass
class LogitsControls:
    """One step's controls, for the ``R`` rows of the batch that use one (``rows``, [R] int64)."""

    rows: torch.Tensor
    # (row, token, bias) triples, rows indexing 0..R-1: [N] int64, [N] int64, [N] float32
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (row, token) pairs to mask with -inf (EOS and stop token ids below min_tokens)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # penalties, [R] float32 each, neutral values on rows that do not use them
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None  # [R, V] bool: the token occurs in the prompt
    output_counts: torch.Tensor | None = None  # [R, V] float32: occurrences in the output


def build_controls(seqs: list[Sequence], eos_token_ids: Collection[int], vocab_size: int,
                   device: torch.device, pending_tokens: torch.Tensor | None = None,
                   pending_src: dict[int, int] | None = None,
                   cache: TokenCache | None = None) -> LogitsControls | None:
    """The controls of a step that samples one token for each of ``seqs``; None if none is used.

    ``pending_tokens`` ([B'] int64, on ``device``) are the previous step's samples and
    ``pending_src`` maps a seq_id to its row there: a sequence with ``num_pending`` 1 has its
    next output token only there. ``cache`` keeps the token copies from step to step (without
    one, every token is copied again).
    """
    used = [i for i, seq in enumerate(seqs) if seq.params.has_logit_controls]
    if not used:
        return None
    controls = LogitsControls(rows=to_device(used, torch.int64, device))
    params = [seqs[i].params for i in used]
    bias = [(r, t, b) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if t < vocab_size]
    if bias:
        rows, tokens, values = zip(*bias, strict=True)
        controls.bias = (to_device(list(rows), torch.int64, device), to_device(list(tokens), torch.int64, device),
                         to_device(list(values), torch.float32, device))
    banned = []
    for r, i in enumerate(used):
        seq = seqs[i]
        if seq.num_output_tokens + seq.num_pending < seq.params.min_tokens:
            stops = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(eos_token_ids))
            banned += [(r, t) for t in sorted(stops) if t < vocab_size]
    if banned:
        rows, tokens = zip(*banned, strict=True)
        controls.banned = (to_device(list(rows), torch.int64, device), to_device(list(tokens), torch.int64, device))
    if any(p.has_penalties for p in params):
        _add_penalties(controls, [seqs[i] for i in used], vocab_size, device, pending_tokens, pending_src or {},
                       cache if cache is not None else TokenCache())
    return controls


def _add_penalties(controls: LogitsControls, seqs: list[Sequence], vocab_size: int, device: torch.device,
                   pending_tokens: torch.Tensor | None, pending_src: dict[int, int], cache: TokenCache) -> None:
    R = len(seqs)
    params = [seq.params for seq in seqs]
    if any(p.repetition_penalty != 1.0 for p in params):
        controls.repetition = to_device([p.repetition_penalty for p in params], torch.float32, device)
        prompts = [cache.prompt_ids(seq, device) if p.repetition_penalty != 1.0 else None
                   for seq, p in zip(seqs, params, strict=True)]
        mask = torch.zeros(R, vocab_size, dtype=torch.bool, device=device)
        rows, tokens = _scatter_index(prompts, device)
        mask.index_put_((rows, tokens), torch.ones(rows.shape, dtype=torch.bool, device=device))
        controls.prompt_mask = mask
    if any(p.presence_penalty != 0.0 for p in params):
        controls.presence = to_device([p.presence_penalty for p in params], torch.float32, device)
    if any(p.frequency_penalty != 0.0 for p in params):
        controls.frequency = to_device([p.frequency_penalty for p in params], torch.float32, device)
    counts = torch.zeros(R, vocab_size, dtype=torch.float32, device=device)
    outputs = [cache.output_ids(seq, device) if seq.num_output_tokens else None for seq in seqs]
    if any(t is not None for t in outputs):
        rows, tokens = _scatter_index(outputs, device)
        counts.index_put_((rows, tokens), torch.ones(rows.shape, device=device), accumulate=True)
    pending = [(r, pending_src[seq.seq_id]) for r, seq in enumerate(seqs) if seq.num_pending]
    if pending:
        if pending_tokens is None:
            raise ValueError("a sequence has a pending token: pass the previous step's sampled ids")
        rows, src = zip(*pending, strict=True)
        tokens = pending_tokens[to_device(list(src), torch.int64, device)]
        ones = torch.ones(len(rows), dtype=torch.float32, device=device)
        counts.index_put_((to_device(list(rows), torch.int64, device), tokens), ones, accumulate=True)
    controls.output_counts = counts


def _scatter_index(per_row: list[torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors for per-row token tensors (None: no tokens), built on the device:
    the host handles R lengths, not the tokens."""
    lengths = [0 if t is None else t.numel() for t in per_row]
    tokens = torch.cat([t for t in per_row if t is not None])
    rows = torch.repeat_interleave(torch.arange(len(per_row), device=device), to_device(lengths, torch.int64, device),
                                   output_size=sum(lengths))  # output_size given: no sync
    return rows, tokens


class TokenCache:
    """Per-sequence device copies of the token ids the penalties read, so that a step copies only
    what is new: a prompt's distinct ids once, the output ids as they are appended. Output tokens
    are never taken back (a recomputed sequence keeps them), so the copies stay valid until
    ``forget``; the engine calls it when a sequence finishes."""

    def __init__(self):
        self._prompt: dict[int, torch.Tensor] = {}
        self._output: dict[int, tuple[torch.Tensor, int]] = {}

    def forget(self, seq_id: int) -> None:
        self._prompt.pop(seq_id, None)
        self._output.pop(seq_id, None)

    def prompt_ids(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        """The distinct prompt token ids: [N] int64."""
        ids = self._prompt.get(seq.seq_id)
        if ids is None or ids.device != device:
            ids = to_device(sorted(set(seq.prompt_token_ids)), torch.int64, device)
            self._prompt[seq.seq_id] = ids
        return ids

    def output_ids(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        """The output token ids the host knows: [num_output_tokens] int64 (a view)."""
        n = seq.num_output_tokens
        buf, known = self._output.get(seq.seq_id, (None, 0))
        if buf is None or buf.device != device or buf.numel() < n:
            grown = torch.empty(max(seq.params.max_tokens, n), dtype=torch.int64, device=device)
            if buf is not None and buf.device == device:
                grown[:known] = buf[:known]
            else:
                known = 0
            buf = grown
        if n > known:
            buf[known:n] = to_device(seq.output_token_ids[known:n], torch.int64, device)
        self._output[seq.seq_id] = (buf, n)
        return buf[:n]


def apply_controls(logits: torch.Tensor, controls: LogitsControls) -> torch.Tensor:
    """A new [B, V] float32 tensor: ``logits`` with the controls applied to their rows."""
    # logits: [B, V] float32; never changed in place (it may be a CUDA graph's output buffer)
    sub = logits.index_select(0, controls.rows)  # [R, V], a copy
    if controls.bias is not None:
        rows, tokens, values = controls.bias
        sub.index_put_((rows, tokens), values, accumulate=True)
    if controls.banned is not None:
        rows, tokens = controls.banned
        sub.index_put_((rows, tokens), sub.new_full(rows.shape, float("-inf")))  # a fill: no host copy
    counts = controls.output_counts
    if controls.repetition is not None:
        seen = controls.prompt_mask | (counts > 0)
        penalty = torch.where(seen, controls.repetition[:, None], 1.0)
        sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    if controls.frequency is not None:
        sub = sub - controls.frequency[:, None] * counts
    if controls.presence is not None:
        sub = sub - controls.presence[:, None] * (counts > 0).float()
    return logits.index_copy(0, controls.rows, sub)
