"""The engine on a background thread, fed by asyncio request handlers.

One thread owns the ``LLMEngine`` (and so every Sequence and page): handlers never touch it.
They post commands (add, abort) to a thread-safe inbox that the engine thread drains between
steps, and receive outputs on their own ``asyncio.Queue`` through ``call_soon_threadsafe``. A
model error fails the requests in flight (their pages are freed), not the server; an error marked
``engine_fatal`` (a tensor-parallel rank that died) fails them and stops the engine thread, so
``/health`` and every later request answer 503.

``num_waiting`` counts requests not yet holding pages (in the inbox or the scheduler's queue,
preempted ones included) without reading the engine from another thread: adds posted but not yet
reflected in a stats snapshot are counted on the side, under a lock shared with the snapshot.

Latencies (runtime/latency.py): after each step the engine thread hands the step's observations
to every ``latency_observers`` callable (the server's histograms), before delivering the outputs,
so a client that reads ``/metrics`` after its response finds its request counted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from oscar_compile.runtime.core.errors import EngineDeadError
from oscar_compile.runtime.engine import LLMEngine, RequestOutput
from oscar_compile.runtime.input_processor import EngineRequest
from oscar_compile.runtime.latency import StepLatencies
from oscar_compile.runtime.stats import EngineStats

logger = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class Sink:
    """Where a request's outputs go: ``queue`` on ``loop``, each as ``(tag, item)``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tag: Any = None


@dataclass(frozen=True)
class AddRequest:
    request: EngineRequest
    sink: Sink


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class FailAll:
    """Abort every request and hand each handler ``error`` (a drain out of time)."""

    error: BaseException


Command = AddRequest | AbortRequest | FailAll  # what handlers post to the engine thread


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stop = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None
        self.stats: EngineStats = engine.stats()  # snapshot, refreshed by the engine thread
        self._lock = threading.Lock()  # guards stats together with _num_unseen_adds, and _closed
        self._closed = False  # the engine thread has stopped taking requests
        self._num_unseen_adds = 0  # adds posted that no snapshot counts yet
        self._num_drained_adds = 0  # engine thread: adds drained since the last snapshot
        # called on the engine thread with each step's StepLatencies; replaced, never mutated
        self.latency_observers: tuple[Callable[[StepLatencies], None], ...] = ()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._closed = False
            self._thread = threading.Thread(target=self._run, name="oscar-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- called from handlers (any thread) -----------------------------------------------------
    def submit(self, request: EngineRequest, sink: asyncio.Queue, tag: Any = None) -> None:
        """Queue a validated request (``engine.input_processor``; nothing is checked again); its
        outputs (of every choice, when ``params.n`` > 1) arrive on ``sink`` as ``(tag,
        RequestOutput)`` until one has ``request_finished``, or ``(tag, exception)`` if it fails."""
        if not self.is_alive:
            raise EngineDeadError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        with self._lock:  # (the thread's last drain takes this lock: no add can slip in after it)
            if self._closed:
                raise EngineDeadError("the engine thread is not running")
            self._num_unseen_adds += 1
            self._inbox.put(AddRequest(request, Sink(loop, sink, tag)))
        self._wakeup.set()

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission: posted adds plus the scheduler's waiting queue."""
        with self._lock:
            return self._num_unseen_adds + self.stats.num_waiting

    def fail_all(self, err: BaseException) -> None:
        """Abort every request (pages freed) and hand each handler ``err``; used when a
        graceful shutdown runs out of time."""
        self._inbox.put(FailAll(err))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        self._inbox.put(AbortRequest(request_id))
        self._wakeup.set()

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one validated request (it needs a ``request_id``); leaving the loop early
        (client gone) aborts it."""
        sink: asyncio.Queue = asyncio.Queue()
        self.submit(request, sink)
        finished = False
        try:
            while not finished:
                _, item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.request_finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        logger.info("engine thread started")
        final_err: BaseException = EngineDeadError("the server is shutting down")
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._publish_stats()
                self._wakeup.wait(_IDLE_WAIT_S)
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # a model error must not take the server down
                if getattr(err, "engine_fatal", False):  # e.g. a tensor-parallel rank died: no step can run
                    logger.critical("engine cannot run any more steps, stopping it (/health now fails): %s", err)
                    final_err = err
                    break
                logger.exception("engine step failed; failing the running requests")
                self._fail_all(err)
                continue
            self._publish_stats()  # before delivery: a client reads it after its output
            self._observe(self.engine.latencies)
            for out in outputs:  # a request that failed alone (its grammar did not compile) gets its error
                self._deliver(out.request_id, out.error if out.error is not None else out, out.request_finished)
        with self._lock:
            self._closed = True
        self._fail_posted_adds(final_err)  # posted before the thread stopped: their handlers wait too
        self._fail_all(final_err)
        self._publish_stats()
        logger.info("engine thread stopped")

    def _fail_posted_adds(self, err: BaseException) -> None:
        for command in self._posted():
            if isinstance(command, AddRequest):
                self._num_drained_adds += 1
                self._sinks[command.request.request_id] = command.sink
                self._deliver(command.request.request_id, err, True)

    def _observe(self, latencies: StepLatencies) -> None:
        if not latencies:
            return
        for observe in self.latency_observers:
            try:
                observe(latencies)
            except Exception:  # a metrics sink must not fail the requests
                logger.exception("latency observer %r failed", observe)

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        with self._lock:
            self.stats = stats
            self._num_unseen_adds -= self._num_drained_adds
            self._num_drained_adds = 0

    def _posted(self) -> Iterator[Command]:
        """The inbox's commands, until it is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for command in self._posted():
            if isinstance(command, AbortRequest):
                for out in self.engine.abort_request(command.request_id):
                    self._deliver(out.request_id, out, out.request_finished)
            elif isinstance(command, FailAll):
                self._fail_all(command.error)
            else:
                request_id = command.request.request_id
                self._num_drained_adds += 1
                self._sinks[request_id] = command.sink
                try:
                    self.engine.add(command.request)
                except Exception as err:
                    self._deliver(request_id, err, True)

    def _deliver(self, request_id: str, item, finished: bool) -> None:
        sink = self._sinks.pop(request_id, None) if finished else self._sinks.get(request_id)
        if sink is None:
            return
        try:
            sink.loop.call_soon_threadsafe(sink.queue.put_nowait, (sink.tag, item))
        except RuntimeError:  # the handler's loop is closed: nobody is listening
            logger.debug("dropped output for %s", request_id)

    def _fail_all(self, err: BaseException) -> None:
        for request_id in list(self._sinks):
            self.engine.abort_request(request_id)
            self._deliver(request_id, err, True)
