"""The device side of a step: the runner's forward, prompt scoring, logit controls, the grammar
mask and sampling, returned as typed outputs (vLLM's ``GPUModelRunner`` and its
``ModelRunnerOutput``; nano-vllm's ``model_runner.run``, which samples). The engine decides what
runs and reads the outputs; everything that touches logits happens here.

A step is two calls, so that the engine keeps its overlap of steps and the order of grammar work
(``runtime/structured_output/__init__.py``): ``execute`` queues the forward, scores the prompt
rows (the one host sync of those steps only) and returns a ``ForwardOutput``, the logits of the
rows that draw a token with their logit controls; ``sample`` queues the draw, with the grammar
bitmask the engine filled meanwhile, and returns a ``ModelRunnerOutput`` whose tokens stay on the
device until ``result()``, which the engine calls a step later when steps overlap.

Host time: a decode step that samples every row gathers nothing and copies no index; the only
objects made per step are the two small outputs, as before the split.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from oscar_compile.runtime.core.page_manager import PageManager
from oscar_compile.runtime.core.scheduler import SchedulerOutput
from oscar_compile.runtime.core.sequence import Sequence
from oscar_compile.runtime.core.token_logprob import TokenLogprob
from oscar_compile.runtime.worker.logits_controls import LogitsControls, build_controls
from oscar_compile.runtime.worker.logprobs import score_tokens
from oscar_compile.runtime.worker.runner import Batch, ModelRunner
from oscar_compile.runtime.worker.sampler import DeviceSample, Sampler, SampleResult, to_device

_ROW_FIELDS = ("seq_ids", "token_ids", "positions", "cache_lens", "history_lens", "window_tables", "quant_tables",
               "context_token_ids", "pending_rows", "pending_src", "staging_tables", "staging_ends", "logit_rows")


@dataclass
class ForwardOutput:
    """A step whose forward is queued and whose draw is not: ``logits`` row j is ``seqs[j]``'s
    (``[len(seqs), V]``, float, on the device)."""

    seqs: list[Sequence]
    logits: torch.Tensor
    controls: LogitsControls | None


@dataclass
class ModelRunnerOutput:
    """A step's draws, row j ``seqs[j]``'s, on their way to the host (``DeviceSample``)."""

    seqs: list[Sequence]
    sample: DeviceSample
    grammars_advanced: bool = False  # the engine fed these tokens to the grammars (structured output)

    def result(self) -> SampleResult:
        """The tokens on the host (waits for this step's copies only)."""
        return self.sample.result()

    def rows_by_seq(self) -> dict[int, int]:
        """seq_id -> its row: where the next step finds a sequence's pending token."""
        return {seq.seq_id: j for j, seq in enumerate(self.seqs)}


# (sequence, prompt position, its score): prompt logprobs computed by a step
PromptScore = tuple[Sequence, int, TokenLogprob]
_NO_SCORES: tuple[PromptScore, ...] = ()  # a step without prompt rows allocates no list


class Worker:
    def __init__(self, runner: ModelRunner, eos_token_ids: frozenset[int]):
        self.runner = runner
        self.eos_token_ids = eos_token_ids  # min_tokens bans them (logit controls)
        self.sampler = Sampler()

    def forget(self, seq_id: int) -> None:
        """Drop a finished sequence's device state (the penalties' token copies)."""
        self.sampler.forget(seq_id)

    def execute(self, batch: Batch, batch_seqs: list[Sequence], seqs: list[Sequence], rows: list[int],
                in_flight: ModelRunnerOutput | None, pending_src: dict[int, int]
                ) -> tuple[ForwardOutput | None, Seq[PromptScore]]:
        """Run ``batch`` (row i is ``batch_seqs[i]``); ``seqs[j]`` draws from logits row
        ``rows[j]`` (None when no row draws). ``in_flight``: the step whose tokens are pending,
        ``pending_src`` their rows there."""
        tokens = in_flight.sample.token_ids if batch.pending_rows else None
        logits = self.runner.run(batch, tokens) if tokens is not None else self.runner.run(batch)
        scores = _NO_SCORES
        if batch.logit_rows:
            scores = _score_prompts(batch, batch_seqs, logits[batch.num_seqs:])
            # a copy of the drawing rows: a view would keep every scored row's logits alive while
            # this step is in flight, beside the next step's (4.6 GiB at 8192 Qwen3 tokens)
            logits = logits[:batch.num_seqs].clone()
        if not rows:
            return None, scores
        # a decode step samples every row: no gather (and no copy of the index). The logits may
        # then be a replayed CUDA graph's output buffer: sampling is queued before the next replay.
        if rows != list(range(len(batch_seqs))):
            logits = logits[to_device(rows, torch.int64, logits.device)]
        # None unless a request uses penalties, logit_bias or min_tokens: then nothing more runs
        controls = build_controls(seqs, self.eos_token_ids, logits.shape[-1], logits.device,
                                  in_flight.sample.token_ids if in_flight is not None else None, pending_src,
                                  self.sampler.token_cache)
        return ForwardOutput(seqs, logits, controls), scores

    def sample(self, forward: ForwardOutput, bitmask: torch.Tensor | None) -> ModelRunnerOutput:
        """Queue the draw of ``forward``'s rows; ``bitmask``: the grammars' allowed tokens, or None."""
        seqs = forward.seqs
        # the position of the token each row draws: after its known and pending tokens
        sample = self.sampler.sample(forward.logits, [s.params for s in seqs], [s.seed for s in seqs],
                                     [s.num_tokens + s.num_pending for s in seqs], forward.controls, bitmask)
        return ModelRunnerOutput(seqs, sample)


def build_batch(out: SchedulerOutput, page_manager: PageManager, pending_src: dict[int, int]) -> Batch:
    """The runner's view of a scheduled step: plain lists, row i for ``out.seqs[i]``. A row
    whose next token is still on the device (``pending_src``: seq_id -> row of the step in
    flight) runs a placeholder that the runner replaces."""
    fields: dict[str, list] = {name: [] for name in _ROW_FIELDS}
    for row, (seq, num_new) in enumerate(zip(out.seqs, out.num_new_tokens, strict=True)):
        L = seq.num_cached_tokens
        ids = seq.token_ids[L:L + num_new]
        if len(ids) < num_new:  # the pending token: one, sampled by the step in flight
            fields["pending_rows"].append(row)
            fields["pending_src"].append(pending_src[seq.seq_id])
            ids = [0]
        fields["seq_ids"].append(seq.seq_id)
        fields["token_ids"].append(ids)
        fields["positions"].append(list(range(L, L + num_new)))
        fields["cache_lens"].append(L)
        fields["history_lens"].append(page_manager.history_len(seq))
        fields["window_tables"].append(seq.window_pages)
        fields["quant_tables"].append(seq.quant_pages)
        fields["context_token_ids"].append(seq.token_ids)
        fields["staging_tables"].append(seq.staging_pages)
        if seq.is_staged and L + num_new >= seq.num_tokens:
            fields["staging_ends"].append(row)
        if seq.wants_prompt_logprobs and L + 1 < seq.num_prompt_tokens and seq.prompt_logprobs[-1] is None:
            fields["logit_rows"].append(row)
    for name in ("pending_rows", "pending_src", "staging_ends", "logit_rows"):
        fields[name] = tuple(fields[name])
    if not any(fields["staging_tables"]):
        fields["staging_tables"] = ()
    if out.snapshot_takes:
        row_of = {id(seq): row for row, seq in enumerate(out.seqs)}
        fields["snapshot_takes"] = tuple((row_of[id(seq)], take) for seq, take in out.snapshot_takes)
    return Batch(layout=page_manager.layout, **fields)


def _score_prompts(batch: Batch, batch_seqs: list[Sequence], logits: torch.Tensor) -> list[PromptScore]:
    """The prompt logprobs of the ``logit_rows``: the logits at position ``p`` score prompt token
    ``p + 1``. logits: ``[sum of their T_i, V]``, row by row."""
    keep, targets, slots = [], [], []
    offset = 0
    for i in batch.logit_rows:
        seq = batch_seqs[i]
        for j, position in enumerate(batch.positions[i]):
            if position + 1 < seq.num_prompt_tokens:
                keep.append(offset + j)
                targets.append(seq.token_ids[position + 1])
                slots.append((seq, position + 1))
        offset += len(batch.positions[i])
    if not keep:
        return []
    k = max(seq.params.prompt_logprobs for seq, _ in slots)
    scored = score_tokens(logits, targets, k, rows=None if len(keep) == offset else keep)
    scores = []
    for n, (seq, index) in enumerate(slots):
        top_k = seq.params.prompt_logprobs
        top = list(zip(scored.top_ids[n][:top_k], scored.top_logprobs[n][:top_k], strict=True))
        scores.append((seq, index, TokenLogprob(targets[n], scored.logprobs[n], top, scored.ranks[n])))
    return scores
