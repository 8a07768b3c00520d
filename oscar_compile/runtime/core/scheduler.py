"""Continuous batching: which sequences run this step, with how many new tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running sequences are served first,
oldest first: a decoding sequence takes 1 token, one still prefilling takes the next chunk of its
prompt (chunked prefill) up to what is left of the budget. Then waiting sequences are admitted in
arrival order while budget, sequence slots and pages allow; the head of the queue is never
skipped, so no request starves (FCFS).

When a running sequence needs a page and none is left, the newest running sequence is preempted
and goes back to the front of the queue. With host swap space (page_manager, "Swapping") its
pages are swapped out and swapped back in before it runs again: exact, and cheap next to
recomputing a long context. Without room there (or while it is still staged) its pages are freed
and it is recomputed (its tokens are kept; its finished history blocks stay in the prefix cache
until evicted). The oldest sequence is never preempted for a newer one, and ``add`` refuses a
request that could not fit the pools even alone, so every request finishes.

A prompt that needs several chunks is admitted with its staging pages (page_manager, "Deferred
demotion") or waits at the head of the queue until they are free; one whose history the staging
pool could never hold is admitted only when the step's budget takes the whole prompt at once.

A request of n choices (parallel sampling) is admitted as one sequence with the pages its
choices will take reserved, and counts as n against ``max_num_seqs``; once its prompt is cached
``fork`` puts the choices into ``running`` right after it (their seq_ids were reserved at its
arrival, so the order below holds).

Window snapshots (page_manager, "Window snapshots"; decode-consistent prefill only) cut no
chunk: once the step's admissions are done, each chunk that passes a snapshot boundary gets the
snapshots it takes inside the step (``SchedulerOutput.snapshot_takes``: its pages are the ones no
admission wanted), ``advance`` returns the copies that take the snapshots where a chunk ends at a
boundary, and an admission at a snapshot leaves the copy that restores it in
``SchedulerOutput.page_copies``; the runner makes each before the next forward.

Deterministic mode (``PageManager.make_deterministic``): ``cut_chunk`` may give a sequence 0
tokens in a step (a chunk would hold or leave one prompt token); it then waits for the next step,
and a recomputed sequence's generated tokens come one per step.

Invariant (tested): every running sequence arrived before every waiting one, so ``running`` is
sorted by arrival and ``running[-1]`` is the newest.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from oscar_compile.runtime.core.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from oscar_compile.runtime.core.page_manager import PageCopy, PageManager, SwapCopy
from oscar_compile.runtime.core.page_records import SnapshotTake
from oscar_compile.runtime.core.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """The step's work: ``seqs[i]`` caches ``num_new_tokens[i]`` more tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swap_out: list[SwapCopy] = field(default_factory=list)  # copy these out before the forward
    swap_in: list[SwapCopy] = field(default_factory=list)  # then these in
    page_copies: list[PageCopy] = field(default_factory=list)  # window snapshots into new rings: first of all
    # window snapshots the forward takes inside chunks (window_snapshots.py, "Boundaries")
    snapshot_takes: list[tuple[Sequence, SnapshotTake]] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, page_manager: PageManager, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.page_manager = page_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of num_preemptions: swapped out (the rest are recomputed)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for admission (new, preempted or swapped out): they hold no pages."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Sequences that hold pages and take part in the next step."""
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def max_num_tokens(self, seq: Sequence) -> int:
        """The most tokens ``seq`` can ever hold: prompt + max_tokens, capped by the context."""
        total = seq.num_prompt_tokens + seq.params.max_tokens
        return total if self.max_model_len is None else min(total, self.max_model_len)

    def add(self, seq: Sequence) -> None:
        """Queue a new request; refuses one that could never fit the page pools alone."""
        if seq.num_prompt_tokens < 1:
            raise ValueError("prompt must hold at least one token")
        num_tokens = self.max_num_tokens(seq)
        if not self.page_manager.can_ever_fit(num_tokens, seq.params.n, seq.num_prompt_tokens):
            raise ValueError(
                f"a sequence of {num_tokens} tokens needs more KV pages than the cache holds; "
                "lower max_tokens or raise the KV memory"
            )
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # pages are short: let the preempted catch up before admitting
            self._schedule_waiting(out, budget)
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):  # after every admission
            out.snapshot_takes += [(seq, take) for take in self.page_manager.plan_snapshots(seq, num_new)]
        return out

    def advance(self, out: SchedulerOutput) -> list[PageCopy]:
        """The runner has cached the step's tokens: move counters, publish finished blocks.
        Sequences that ended meanwhile (an overlapped step read their last token) are skipped.
        Returns the window snapshots' copies, to make before the next forward."""
        captures = []
        for seq, num_new in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_cached_tokens += num_new
            if seq.is_staged and seq.num_cached_tokens >= seq.num_tokens:
                self.page_manager.end_staging(seq)  # the runner quantized the staged history
            self.page_manager.commit(seq)
            capture = self.page_manager.capture_snapshot(seq)
            if capture is not None:
                captures.append(capture)
        return captures

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (stop, length or abort) wherever it is and free its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.SWAPPED) and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.has_pages or seq.swap is not None:
            self.page_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def fork(self, parent: Sequence, children: list[Sequence]) -> PageCopy:
        """Run the other choices of ``parent`` (its prompt just cached) from the next step on; the
        runner copies the returned pages before that step's forward."""
        copy = self.page_manager.fork(parent, children)
        for child in children:
            child.status = SequenceStatus.RUNNING
        index = self.running.index(parent) + 1
        self.running[index:index] = children
        return copy

    # ---- helpers -----------------------------------------------------------------------------
    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_pending and seq.num_tokens + seq.num_pending >= self.max_num_tokens(seq):
                index += 1  # its last token is still on the device: it ends when that arrives
                continue
            num_new = self.page_manager.cut_chunk(seq, seq.num_cached_tokens, min(seq.num_uncached_tokens, budget))
            if not num_new:  # deterministic mode: the budget left would cut a one-token chunk
                index += 1
                continue
            if not self._make_room(seq, num_new, out):
                break  # seq itself was the newest and got preempted
            self.page_manager.may_append(seq, num_new)
            out.add(seq, num_new)
            budget -= num_new
            index += 1
        return budget

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until ``seq`` can grow; False if seq went too."""
        while not self.page_manager.can_append(seq, num_new):
            victim = self.running[-1]
            self._preempt(victim, out)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.pop()
        if self.page_manager.can_swap_out(seq):
            out.swap_out.append(self.page_manager.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            seq.num_swaps += 1
            self.num_swap_preemptions += 1
        else:
            self.page_manager.deallocate(seq)
            seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted %s (%s)", seq, seq.status.value)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.num_forks > self.max_num_seqs:
                break  # its choices would not fit the sequence slots
            num_new = (self._swap_in(seq, budget, out) if seq.status is SequenceStatus.SWAPPED
                       else self._admit(seq, budget, out))
            if not num_new:
                break
            self.waiting.popleft()
            self.page_manager.may_append(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.add(seq, num_new)
            budget -= num_new

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Allocate the pages (and staging pages) of a new or recomputed ``seq``; its first chunk
        length, or 0 if it must wait."""
        page_manager = self.page_manager
        match = page_manager.match_prefix(seq)
        num_new = page_manager.cut_chunk(seq, match.num_tokens, min(seq.num_tokens - match.num_tokens, budget))
        if not num_new:
            return 0  # deterministic mode: the budget left would cut a one-token chunk
        num_staging = page_manager.staging_need(seq, match, num_new)
        if num_staging > page_manager.staging_pool.num_pages:
            if seq.num_output_tokens == 0:
                return 0  # a prompt too long to stage: only in one chunk (engine.input_processor)
            num_staging = 0  # recomputing a sequence that has outputs: inexact anyway
        if not page_manager.can_allocate(seq, match, num_new, num_staging):
            return 0
        copy = page_manager.allocate(seq, match, num_staging)
        if copy is not None:
            out.page_copies.append(copy)
        return num_new

    def _swap_in(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        num_new = self.page_manager.cut_chunk(seq, seq.num_cached_tokens, min(seq.num_uncached_tokens, budget))
        if num_new < 1 or not self.page_manager.can_swap_in(seq, num_new):
            return 0
        out.swap_in.append(self.page_manager.swap_in(seq))
        return num_new
