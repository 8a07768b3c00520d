"""Rank 0 steps, the other ranks follow: the step protocol of tensor-parallel serving.

Only rank 0 runs the engine (scheduler, block manager, sampler). Every rank runs the same
``CompressedRunner`` over its own slice of the model (``oscar_compile.tensor_parallel.shard``)
and its own KV heads' pages; the page ids are the same on every rank, so one block manager
serves all of them. Each step rank 0 sends what its runner is about to run, and the other ranks
run the same step on their runners; the row-wise projections all-reduce inside the forward, so
every rank ends the step with the same hidden states and logits (only rank 0 samples).

Two process groups, as vLLM keeps them: the *data* group (NCCL on GPUs, gloo on CPUs) carries
the all-reduces and the pending tokens (the previous step's samples, still on the device:
``Batch.pending_rows``); the *control* group (gloo, always on the host) carries the step
messages, so sending a step never waits for the GPU. A step message holds the batch's small
fields and, per batch row and table kind, only the page ids appended since that row's table was
last sent (the same identity rule as ``step_inputs.TableMirror``: a table is the engine's list,
only appended to while its sequence runs): a 128k-token sequence adds one quant page every
16 steps, not 8k ids per step.

A rank that dies makes the next collective fail (gloo: the connection closes; NCCL: its
watchdog's timeout) or is seen dead by rank 0 before a step: either way rank 0 raises
:class:`TensorParallelError`, which the server treats as fatal: the requests in flight fail with
it and the engine thread stops, so ``/health`` and every later request answer 503 (async_engine.py).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from oscar_compile.runtime.core.errors import EngineDeadError
from oscar_compile.runtime.worker.runner import Batch

logger = logging.getLogger(__name__)


class TensorParallelError(EngineDeadError):
    """A rank is gone or a collective failed: no later step can run on this group (the server
    answers 503 with this message, naming the rank)."""

    engine_fatal = True  # async_engine: fail every request and stop, rather than retry the next step


@dataclass
class RankGroup:
    """This process's place in the tensor-parallel group.

    ``data_group`` runs the all-reduces and the pending-token broadcast, ``control_group``
    (gloo) the step messages. ``find_dead_rank`` (rank 0) describes a rank whose process has
    ended, or returns None.
    """

    rank: int
    world_size: int
    data_group: Any = None
    control_group: Any = None
    find_dead_rank: Callable[[], str | None] = lambda: None

    def send(self, message) -> None:
        """Rank 0: hand ``message`` (any picklable object) to every other rank."""
        dist.broadcast_object_list([message], src=0, group=self.control_group)

    def receive(self):
        """Other ranks: the next message rank 0 sends."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def fail(self, err: BaseException | None = None, wait_s: float = 5.0) -> TensorParallelError:
        """The error to raise when a send or a collective failed: it names the rank that died when
        one did (a peer's socket closes a moment before its process can be reaped: wait for it)."""
        dead = self.find_dead_rank()
        deadline = time.monotonic() + (wait_s if err is not None else 0.0)
        while dead is None and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.find_dead_rank()
        what = dead or f"a collective failed ({err})"
        return TensorParallelError(f"tensor-parallel group of {self.world_size} ranks is broken: {what}")


class _TableSender:
    """Rank 0's record of the table each batch row last sent: encodes only what was appended."""

    def __init__(self):
        self._sent: list[tuple[Seq[int] | None, int]] = []

    def encode(self, tables: Seq[Seq[int]]) -> list[tuple[int, list[int]]]:
        """Per row ``(start, ids)``: ``ids`` extend the row's previous table from ``start``, or
        replace it (``start = -1``)."""
        out = []
        self._sent += [(None, 0)] * (len(tables) - len(self._sent))
        for i, table in enumerate(tables):
            obj, done = self._sent[i]
            start = done if obj is table and len(table) >= done else -1
            out.append((start, list(table[max(start, 0):])))
            self._sent[i] = (table, len(table))
        del self._sent[len(tables):]
        return out


class _TableReceiver:
    """The other ranks' copy of each row's table; a row extended in place stays the same list, so
    the runner's TableMirror uploads only the new ids there too."""

    def __init__(self):
        self._rows: list[list[int]] = []

    def decode(self, encoded: list[tuple[int, list[int]]]) -> list[list[int]]:
        self._rows += [[] for _ in range(len(encoded) - len(self._rows))]
        for i, (start, ids) in enumerate(encoded):
            if start < 0:
                self._rows[i] = list(ids)
            else:
                if len(self._rows[i]) != start:
                    raise TensorParallelError(f"step message out of order: row {i} holds {len(self._rows[i])} "
                                              f"page ids, the message extends it from {start}")
                self._rows[i].extend(ids)
        del self._rows[len(encoded):]
        return list(self._rows)


_TABLE_KINDS = ("window_tables", "quant_tables", "staging_tables")


class StepEncoder:
    """Rank 0: a Batch as a compact, picklable step message."""

    def __init__(self):
        self._tables = {kind: _TableSender() for kind in _TABLE_KINDS}

    def encode(self, batch: Batch, num_pending_tokens: int) -> dict:
        tables = {kind: self._tables[kind].encode(getattr(batch, kind)) for kind in _TABLE_KINDS
                  if kind != "staging_tables" or batch.staging_tables}  # () when no row is staged
        return dict(seq_ids=batch.seq_ids, token_ids=batch.token_ids, cache_lens=batch.cache_lens,
                    history_lens=batch.history_lens, pending_rows=batch.pending_rows,
                    pending_src=batch.pending_src, staging_ends=batch.staging_ends,
                    snapshot_takes=batch.snapshot_takes, num_pending_tokens=num_pending_tokens, **tables)


class StepDecoder:
    """The other ranks: step messages back into Batches (the runner needs no token history)."""

    def __init__(self, layout):
        self.layout = layout
        self._tables = {kind: _TableReceiver() for kind in _TABLE_KINDS}

    def decode(self, message: dict) -> Batch:
        tables = {kind: self._tables[kind].decode(message[kind]) for kind in _TABLE_KINDS if kind in message}
        staging = tuple(tables.pop("staging_tables", ()))
        positions = [list(range(L, L + len(ids)))
                     for L, ids in zip(message["cache_lens"], message["token_ids"], strict=True)]
        return Batch(seq_ids=message["seq_ids"], token_ids=message["token_ids"], positions=positions,
                     cache_lens=message["cache_lens"], history_lens=message["history_lens"],
                     context_token_ids=[()] * len(message["seq_ids"]), layout=self.layout,
                     pending_rows=message["pending_rows"], pending_src=message["pending_src"],
                     staging_tables=staging, staging_ends=message["staging_ends"],
                     snapshot_takes=message["snapshot_takes"], **tables)


class TensorParallelRunner:
    """Rank 0's runner: sends each step (and each swap) to the other ranks, then runs its own.

    The engine sees an ordinary runner; ``local`` is this rank's ``CompressedRunner``, whose
    logits (every rank computes the same) are the step's result.
    """

    def __init__(self, local, ranks: RankGroup):
        self.local = local
        self.ranks = ranks
        self.vocab_size = local.vocab_size
        # every rank's runner was built from the same kwargs; no prompt logits across ranks yet
        self.capabilities = replace(local.capabilities, prompt_logits=False, tensor_parallel_size=ranks.world_size)
        self._encoder = StepEncoder()
        self._closed = False
        # one message at a time on the control group: a step or swap (engine thread) and the stop
        # (the main thread, at shutdown, maybe while a step still runs) never interleave
        self._lock = threading.Lock()

    @property
    def layout(self):
        return self.local.layout

    @property
    def world_size(self) -> int:
        return self.ranks.world_size

    def _checked(self, fn, *args):
        with self._lock:
            if self._closed:
                raise EngineDeadError("the tensor-parallel ranks were stopped")
            dead = self.ranks.find_dead_rank()
            if dead is not None:
                raise self.ranks.fail()
            try:
                return fn(*args)
            except TensorParallelError:
                raise
            except Exception as err:  # gloo / NCCL errors, or rank 0 failing mid-step while the others wait in
                raise self.ranks.fail(err) from err  # an all-reduce it never joins: the group is out of step

    def run(self, batch: Batch, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        def step():
            num_pending = pending_tokens.numel() if batch.pending_rows else 0
            self.ranks.send(("run", self._encoder.encode(batch, num_pending)))
            if num_pending:
                dist.broadcast(pending_tokens.contiguous(), src=0, group=self.ranks.data_group)
            return self.local.run(batch, pending_tokens) if pending_tokens is not None else self.local.run(batch)

        return self._checked(step)

    def swap(self, swap_out: list, swap_in: list) -> None:
        def copy():
            self.ranks.send(("swap", swap_out, swap_in))
            self.local.swap(swap_out, swap_in)

        self._checked(copy)

    def copy_pages(self, copy) -> None:
        def fork():
            self.ranks.send(("copy_pages", copy))
            self.local.copy_pages(copy)

        self._checked(fork)

    def close(self) -> None:
        """Tell the other ranks to return, after any step in flight (idempotent; a broken group is
        left as it is)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.ranks.find_dead_rank() is None:
                try:
                    self.ranks.send(("stop",))
                except RuntimeError as err:
                    logger.warning("could not stop the tensor-parallel ranks: %s", err)


def follow_steps(runner, ranks: RankGroup) -> None:
    """Ranks other than 0: run every step rank 0 sends until it sends ``stop``."""
    decoder = StepDecoder(runner.layout)
    device = runner.device
    while True:
        message = ranks.receive()
        if message[0] == "stop":
            return
        if message[0] == "swap":
            runner.swap(message[1], message[2])
            continue
        if message[0] == "copy_pages":
            runner.copy_pages(message[1])
            continue
        if message[0] != "run":
            raise TensorParallelError(f"unknown step message {message[0]!r}")
        step = message[1]
        batch = decoder.decode(step)
        if step["num_pending_tokens"]:
            pending = torch.empty(step["num_pending_tokens"], dtype=torch.int64, device=device)
            dist.broadcast(pending, src=0, group=ranks.data_group)
            runner.run(batch, pending)
        else:
            runner.run(batch)
