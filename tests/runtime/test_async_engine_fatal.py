"""A fatal engine error (a tensor-parallel rank died) stops the engine thread: every request
waiting on it, including one posted while the failing step ran, gets the error, none hangs."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from oscar_compile.runtime.async_engine import AsyncEngine
from oscar_compile.runtime.core.errors import EngineDeadError
from oscar_compile.runtime.input_processor import EngineRequest


class FatalEngine:
    """The engine surface AsyncEngine uses; its first step blocks until released, then fails
    as a dead rank does."""

    def __init__(self):
        self.running: list[str] = []
        self.in_step = threading.Event()
        self.release = threading.Event()

    def stats(self):
        return SimpleNamespace(num_waiting=0)

    def add(self, request):
        self.running.append(request.request_id)

    def abort_request(self, request_id):
        return []

    def has_unfinished(self):
        return bool(self.running)

    def step(self):
        self.in_step.set()
        self.release.wait(10)
        err = RuntimeError("rank 1 exited with code -9")
        err.engine_fatal = True
        raise err


def test_requests_posted_during_a_fatal_step_get_the_error():
    async def main():
        engine = FatalEngine()
        ae = AsyncEngine(engine)
        ae.start()
        first, second = asyncio.Queue(), asyncio.Queue()
        ae.submit(EngineRequest("a", [1, 2], None, 0.0), first)
        await asyncio.get_running_loop().run_in_executor(None, engine.in_step.wait, 10)
        ae.submit(EngineRequest("b", [3], None, 0.0), second)  # posted while the failing step runs
        engine.release.set()
        got = [await asyncio.wait_for(q.get(), 10) for q in (first, second)]
        assert all(isinstance(item, RuntimeError) and "rank 1" in str(item) for _, item in got)
        await asyncio.get_running_loop().run_in_executor(None, ae._thread.join, 10)
        with pytest.raises(EngineDeadError):
            ae.submit(EngineRequest("c", [4], None, 0.0), asyncio.Queue())

    asyncio.run(main())
