"""Whether a new generation request gets in, and the drain that ends the server.

The server counts the generation requests it has admitted and not yet answered (a stream counts
until its last byte is sent or its client leaves). A full waiting queue refuses with 503 and
``Retry-After``; so does a draining server (with ``Connection: close``, so a client or a load
balancer goes elsewhere). ``drain`` is the graceful half of shutdown: stop admitting, let the
admitted finish for ``timeout`` seconds, then fail the rest through the engine, which frees
their pages, and wait for their handlers to answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from oscar_compile.runtime.async_engine import AsyncEngine
from oscar_compile.runtime.core.errors import EngineDeadError

logger = logging.getLogger(__name__)
_POLL_S = 0.05
_ANSWER_GRACE_S = 5.0  # after failing the rest: time for their handlers to send the errors
RETRY_AFTER_S = 1


class Refused(Exception):
    """A request the server will not take now: the reply's status, body fields and headers."""

    def __init__(self, status: int, message: str, type_: str, code: str, headers: dict[str, str]):
        super().__init__(message)
        self.status, self.type, self.code, self.headers = status, type_, code, headers


class ShuttingDown(EngineDeadError):
    """Failed by a shutdown that ran out of time."""


class Admission:
    def __init__(self, async_engine: AsyncEngine, max_waiting_requests: int | None = None):
        self.async_engine = async_engine
        self.max_waiting_requests = max_waiting_requests
        self.draining = False
        self.num_in_flight = 0
        self.num_admitted = 0
        self.num_refused = 0

    def check_open(self) -> None:
        """Refuse everything once the server drains."""
        if self.draining:
            self.num_refused += 1
            raise Refused(503, "the server is shutting down and admits no new requests",
                          "service_unavailable", "shutting_down", {"Connection": "close"})

    def enter(self) -> Callable[[], None]:
        """Admit one request (or raise Refused); returns its release, safe to call twice."""
        self.check_open()
        limit = self.max_waiting_requests
        if limit is not None and self.async_engine.num_waiting >= limit:
            self.num_refused += 1
            raise Refused(503, f"the server's queue is full ({limit} requests waiting); retry later",
                          "service_unavailable", "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
        self.num_in_flight += 1
        self.num_admitted += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.num_in_flight -= 1
        return release

    async def drain(self, timeout: float) -> int:
        """Stop admitting; wait up to ``timeout`` s for the in-flight requests, then fail the
        rest. Returns how many were failed."""
        self.draining = True
        logger.info("draining: %d requests in flight, %.1f s to finish", self.num_in_flight, timeout)
        if await self._wait_idle(timeout):
            return 0
        num_failed = self.num_in_flight
        logger.warning("shutdown timeout: aborting %d requests still in flight", num_failed)
        deadline = time.monotonic() + _ANSWER_GRACE_S
        while self.num_in_flight and time.monotonic() < deadline:
            # again each round: a request admitted just before the drain may submit after it
            self.async_engine.fail_all(ShuttingDown("the server shut down before the request finished"))
            await self._wait_idle(0.5)
        return num_failed

    async def _wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        return self.num_in_flight == 0
