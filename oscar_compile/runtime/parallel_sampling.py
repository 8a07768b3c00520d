"""Parallel sampling (``SamplingParams.n``): the choices of a request, forked from its prompt.

A request of n choices runs as one sequence, choice 0, until its prompt is cached: the prompt is
prefilled once. The step that samples choice 0's first token draws every choice's first token
from that same logits row, choice ``i`` with ``seed + i`` (``expand``), as vLLM seeds its
choices; once the step's counters have advanced, ``fork`` gives those choices their pages
(page_manager, "Parallel sampling": the prompt's full pages shared, its window pages and partial
history page copied on the device before the next forward) and the scheduler runs them from the
next step on. Each choice then is an ordinary sequence: it decodes, stops, is preempted (swapped
or recomputed) and finishes on its own, and reads exactly what the request alone with
``seed + i`` would have read: choice ``i`` gives that request's tokens. The engine groups the
choices by request id, so an abort ends them all.
"""

from __future__ import annotations

from oscar_compile.runtime.core.scheduler import Scheduler
from oscar_compile.runtime.core.sequence import Sequence, SequenceStatus


class ChoiceForks:
    """The choices drawn in the step being launched, waiting for their pages."""

    def __init__(self):
        self._pending: list[tuple[Sequence, list[Sequence]]] = []

    def expand(self, seqs: list[Sequence], rows: list[int]) -> tuple[list[Sequence], list[int]]:
        """The step's sampled sequences and their logits rows, plus the other choices of every
        sequence that draws its first token now and has yet to fork: they draw from its row."""
        more_seqs, more_rows = [], []
        for seq, row in zip(seqs, rows, strict=True):
            if seq.num_forks:
                choices = [seq.fork(i) for i in range(1, seq.num_forks + 1)]
                self._pending.append((seq, choices))
                more_seqs += choices
                more_rows += [row] * len(choices)
        return seqs + more_seqs, rows + more_rows

    def fork(self, scheduler: Scheduler, runner) -> list[tuple[Sequence, list[Sequence]]]:
        """Give this step's choices their pages (after ``Scheduler.advance``: the prompt is
        cached) and queue the runner's page copies; returns (first choice, the others) per fork."""
        # (a parent that no longer runs was aborted by a step that failed after ``expand``)
        done = [(parent, choices) for parent, choices in self._pending if parent.status is SequenceStatus.RUNNING]
        self._pending = []
        for parent, choices in done:
            runner.copy_pages(scheduler.fork(parent, choices))
        return done
