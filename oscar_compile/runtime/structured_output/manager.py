"""Compiles constraints off the engine thread, caches them, and keeps each request's grammar.

``compile`` may be called from any thread (the server awaits it before admitting a request, so a
bad schema is a 400 at once); everything else runs on the engine thread. Compiles run on a small
thread pool and are cached by ``StructuredOutputParams.key`` as futures, so concurrent requests
with one schema compile it once; the cache keeps the ``cache_size`` most recently used (a failed
compile is cached too: the same bad schema fails again at once; a missing grammar engine is not,
so the server serves constraints as soon as it is installed). The backend itself (the
tokenizer's view, ~1 s for 151,936 tokens) is built by the first compile, on the pool.

A request whose compile is not done waits here, outside the scheduler: ``take_ready`` hands the
engine those that can be scheduled and those that failed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from oscar_compile.runtime.core.sampling_params import RequestError, StructuredOutputParams
from oscar_compile.runtime.core.sequence import Sequence
from oscar_compile.runtime.structured_output.backend import (
    Grammar,
    GrammarEngineUnavailable,
    StructuredOutputBackend,
    bitmask_width,
    compile_error,
)


class StructuredOutputManager:
    def __init__(
        self,
        make_backend: Callable[[], StructuredOutputBackend],
        vocab_size: int,
        max_workers: int = 2,
        cache_size: int = 256,
    ):
        self._make_backend = make_backend
        self._backend: StructuredOutputBackend | None = None
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="oscar-grammar")
        self._lock = threading.Lock()  # guards the cache
        self._backend_lock = threading.Lock()  # the backend's creation (~1 s): not under the cache's lock
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._waiting: dict[int, tuple[Sequence, Future]] = {}
        self._grammars: dict[int, Grammar] = {}
        self.num_compiles = 0

    # ---- any thread --------------------------------------------------------------------------
    def compile(self, params: StructuredOutputParams) -> Future:
        """The compiled grammar of ``params`` (a future of its own; its exception is a
        RequestError naming this request's field, even when the failure was cached from a request
        that sent the same constraint under another field)."""
        key = params.key
        with self._lock:
            shared = self._cache.get(key)
            submitted = shared is None
            if submitted:
                shared = self._cache[key] = self._pool.submit(self._compile, params)
                self.num_compiles += 1
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if submitted:  # outside the lock: a future already done runs its callback here, and it takes the lock
            shared.add_done_callback(lambda done: self._forget_if_unavailable(key, done))
        future: Future = Future()
        shared.add_done_callback(lambda done: _settle(future, done, params))
        return future

    def _forget_if_unavailable(self, key: str, done: Future) -> None:
        if isinstance(done.exception(), ImportError):
            with self._lock:
                if self._cache.get(key) is done:
                    del self._cache[key]

    def _compile(self, params: StructuredOutputParams):
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
        return self._backend.compile(params)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the engine thread -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._waiting[seq.seq_id] = (seq, self.compile(seq.params.structured_output))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def take_ready(self) -> tuple[list[Sequence], list[tuple[Sequence, RequestError]]]:
        """Requests whose compile ended since the last call: (ready, failed with their error)."""
        ready, failed = [], []
        for seq_id, (seq, future) in list(self._waiting.items()):
            if not future.done():
                continue
            del self._waiting[seq_id]
            err = future.exception()
            if err is not None:
                failed.append((seq, err))
                continue
            self._grammars[seq_id] = self._backend.new_grammar(future.result())
            ready.append(seq)
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a waiting compile ends (the engine has nothing else to run)."""
        if self._waiting:
            wait([future for _, future in self._waiting.values()], timeout, return_when=FIRST_COMPLETED)

    def remove(self, seq_id: int) -> None:
        self._waiting.pop(seq_id, None)
        self._grammars.pop(seq_id, None)

    def is_constrained(self, seq: Sequence) -> bool:
        return seq.seq_id in self._grammars

    def accept(self, seq: Sequence, token_id: int) -> None:
        grammar = self._grammars.get(seq.seq_id)
        if grammar is not None:
            grammar.accept(token_id)

    def is_terminated(self, seq: Sequence) -> bool:
        grammar = self._grammars.get(seq.seq_id)
        return grammar is not None and grammar.is_terminated

    def fill_bitmask(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The batch's bitmask ``[B, ceil(V / 32)]`` int32 on the host (pinned when CUDA is up,
        so its copy to the device can be queued without waiting), row ``b`` from ``seqs[b]``'s
        grammar; unconstrained rows (and terminated grammars, whose step is discarded) allow
        every token. None when no row is constrained."""
        rows = [(b, self._grammars.get(seq.seq_id)) for b, seq in enumerate(seqs)]
        rows = [(b, g) for b, g in rows if g is not None and not g.is_terminated]
        if not rows:
            return None
        pin = torch.cuda.is_available()
        bitmask = torch.full((len(seqs), bitmask_width(self.vocab_size)), -1, dtype=torch.int32, pin_memory=pin)
        self._backend.fill_bitmask([g for _, g in rows], bitmask, [b for b, _ in rows])
        return bitmask


def _settle(future: Future, done: Future, params: StructuredOutputParams) -> None:
    err = done.exception()
    if err is None:
        future.set_result(done.result())
    elif isinstance(err, ImportError):
        message = (f"structured output is unavailable on this server: its grammar engine is not installed ({err}); "
                   "the server's operator can pip install 'oscar-compile[serve]'")
        future.set_exception(GrammarEngineUnavailable(message))
    else:
        future.set_exception(compile_error(params, err))
