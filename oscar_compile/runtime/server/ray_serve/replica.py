"""The engine replica: one engine of today's server (an ``AsyncEngine`` on its thread) in a Ray
Serve deployment.

Why the engine is built by a callable passed in (``make_engine``): assembling a model (the spec,
rotations, a compressed checkpoint, a tensor-parallel split) is the job of ``oscar_compile.assembly``,
a layer above the runtime. The serve command hands its assembly to the replicas as a picklable
callable (``oscar_compile.cli.serve_replicas.EngineRecipe``), so every replica builds the engine the
single-process server would, from the same flags, on its own node.

A replica answers Ray Serve's routing only once its constructor returns, so none is sent a request
before its engine is ready. ``check_health`` fails when the engine thread has stopped (a dead
tensor-parallel rank): Ray Serve then replaces the replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from ray import serve

from oscar_compile.kernels import jit_watch
from oscar_compile.runtime.async_engine import AsyncEngine
from oscar_compile.runtime.core.errors import EngineDeadError
from oscar_compile.runtime.engine import RequestOutput
from oscar_compile.runtime.input_processor import EngineRequest
from oscar_compile.runtime.server.metrics import ServerMetrics
from oscar_compile.runtime.server.ray_serve.limits import EngineLimits
from oscar_compile.runtime.server.ray_serve.prefix_keys import PrefixKeys

logger = logging.getLogger(__name__)


class EngineReplica:
    """``make_engine()`` returns (LLMEngine, its other tensor-parallel ranks or None)."""

    def __init__(self, make_engine: Callable[[], tuple[Any, Any]], model_name: str):
        engine, self._tensor_parallel = make_engine()
        self.async_engine = AsyncEngine(engine)
        jit_watch.install()
        self.server_metrics = ServerMetrics(lambda: self.async_engine.stats, dict, model_name)
        self.async_engine.latency_observers += (self.server_metrics.observe,)
        self.async_engine.start()
        jit_watch.mark_serving()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("engine replica %s ready", self.replica_id)

    def describe(self) -> EngineLimits:
        return EngineLimits.of(self.async_engine.engine)

    async def generate(self, request: EngineRequest, prefix_keys: PrefixKeys | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The outputs of a request the ingress validated, as the engine makes them; a caller that
        stops reading (its client gone, a cancel) aborts it and frees its pages. Its arrival is
        stamped again here: another process's monotonic clock means nothing in this one.
        ``prefix_keys`` is the router's."""
        async for out in self.async_engine.generate(replace(request, arrival_time=time.monotonic())):
            yield out

    def metrics(self) -> tuple[str, bytes, dict[str, float]]:
        """(replica id, its Prometheus text, its stats snapshot): what the ingress's ``/metrics``
        merges."""
        return self.replica_id, self.server_metrics.render(), dict(self.async_engine.stats.flat)

    def check_health(self) -> None:
        if not self.async_engine.is_alive:
            raise EngineDeadError("the engine thread is not running")

    def __del__(self):
        async_engine = getattr(self, "async_engine", None)
        if async_engine is not None:
            async_engine.shutdown()
        if getattr(self, "_tensor_parallel", None) is not None:
            self._tensor_parallel.close()
