"""SIGTERM / SIGINT for the served process: drain, then exit 0; a second signal exits at once.

uvicorn's own handling closes the listening socket at the first signal (new clients get
"connection refused", not a 503 they can act on), waits for open connections without a bound
unless told, and re-raises the signal afterwards, so the process never exits 0. This subclass
keeps listening while ``Admission.drain`` runs (new requests get 503), then lets uvicorn stop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import uvicorn

from oscar_compile.runtime.server.admission import Admission

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, shutdown_timeout_s: float):
        super().__init__(config)
        self.admission = admission
        self.shutdown_timeout_s = shutdown_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signalled = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self._signalled or self._loop is None:
            logger.warning("second %s: exiting now, without finishing in-flight requests", name)
            os._exit(128 + sig)
        self._signalled = True
        logger.info("%s: finishing in-flight requests (up to %.1f s), then exiting", name,
                    self.shutdown_timeout_s)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = self._loop.create_task(self._drain_then_exit())  # kept: tasks are weakly held

    async def _drain_then_exit(self) -> None:
        try:
            await self.admission.drain(self.shutdown_timeout_s)
        finally:
            self.should_exit = True
