"""What the ingress's app calls in place of an ``AsyncEngine``: each request streamed from an
engine replica through a ``DeploymentHandle``.

Why this shape: the single-process server's app (runtime/server/app.py) is written against
``AsyncEngine`` (``submit`` outputs to a queue, ``abort``, ``engine`` for the checks, ``stats``).
Giving it an object with the same surface keeps every route, check and error body one
implementation; this module only moves the outputs across processes.

Faults. Ray Serve retries a request only until a replica accepts it. A replica that dies after
that fails the call with ``ActorDiedError`` (``RayActorError``), or ``ActorUnavailableError``
while its node is unreachable. When none of the request's outputs has reached the app yet, nothing
was sent to the client, so ``RemoteEngine`` sends the request again (the router picks a live
replica), up to ``max_attempts`` times. Once outputs have gone out, the request fails with
``EngineDeadError``: a stream under way ends with an OpenAI error event and ``[DONE]`` (app.py's
stream), any other request is answered 503. Aborting a request cancels its call, which closes the
replica's generator: the replica aborts it and frees its pages.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

from oscar_compile.runtime.core.errors import EngineDeadError
from oscar_compile.runtime.input_processor import EngineRequest
from oscar_compile.runtime.server.ray_serve.limits import EngineLimits, LimitsView
from oscar_compile.runtime.server.ray_serve.prefix_keys import prefix_keys

logger = logging.getLogger(__name__)
DEFAULT_MAX_ATTEMPTS = 3
_REPLICA_GONE = (RayActorError, ActorUnavailableError)  # ActorDiedError is a RayActorError


class RemoteEngine:
    """``AsyncEngine``'s surface over the replicas behind ``handle`` (a handle to ``EngineReplica``)."""

    def __init__(self, handle, limits: EngineLimits, max_attempts: int = DEFAULT_MAX_ATTEMPTS):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.engine = LimitsView(limits)
        self.max_attempts = max_attempts
        self._generate = handle.options(stream=True, method_name="generate")
        self._tasks: dict[str, asyncio.Task] = {}
        self._num_unanswered = 0  # requests sent whose first output has not come back
        self._alive = False
        self.num_retries = 0  # requests sent again after their replica died
        # the replicas' stats summed, as of the last /metrics (what app.py logs at shutdown)
        self.stats: dict[str, float] = defaultdict(float)
        self.latency_observers: tuple = ()  # the replicas observe their own latencies

    # ---- lifecycle (app.py's lifespan) ---------------------------------------------------------
    def start(self) -> None:
        self._alive = True

    def shutdown(self, timeout: float = 5.0) -> None:
        self._alive = False
        for task in list(self._tasks.values()):
            task.cancel()

    @property
    def is_alive(self) -> bool:
        return self._alive

    @property
    def num_waiting(self) -> int:
        """Requests sent that have not had their first output: queued in the router or a replica."""
        return self._num_unanswered

    # ---- what the handlers call ------------------------------------------------------------------
    def submit(self, request: EngineRequest, sink: asyncio.Queue, tag: Any = None) -> None:
        """As ``AsyncEngine.submit``, of a request the ingress validated (``engine.input_processor``):
        outputs arrive on ``sink`` as ``(tag, RequestOutput)`` until one has ``request_finished``,
        or ``(tag, exception)``. The replica measures latencies from when it receives the request."""
        if not self._alive:
            raise EngineDeadError("the server is not running")
        task = asyncio.get_running_loop().create_task(self._relay(request, sink, tag))
        self._tasks[request.request_id] = task

    def abort(self, request_id: str) -> None:
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def fail_all(self, err: BaseException) -> None:
        for request_id in list(self._tasks):
            self.abort(request_id)

    # ---- the relay -------------------------------------------------------------------------------
    def _keys(self, prompt_token_ids: list[int]):
        limits = self.engine.limits
        if limits.routing_interval is None:
            return None
        return prefix_keys(prompt_token_ids, limits.routing_interval, limits.layout.page_size)

    async def _relay(self, request: EngineRequest, sink: asyncio.Queue, tag: Any) -> None:
        request_id = request.request_id
        keys = self._keys(request.prompt_token_ids)
        answered = False
        self._num_unanswered += 1
        try:
            for attempt in range(1, self.max_attempts + 1):
                stream = self._generate.remote(request, prefix_keys=keys)
                try:
                    async for out in stream:
                        if not answered:
                            answered = True
                            self._num_unanswered -= 1
                        sink.put_nowait((tag, out))
                        if out.request_finished:
                            return
                    raise EngineDeadError("the replica ended the request before it finished")
                except _REPLICA_GONE as err:
                    if answered or attempt == self.max_attempts:
                        raise EngineDeadError(f"the replica serving this request died ({type(err).__name__})"
                                              ) from err
                    self.num_retries += 1
                    logger.warning("request %s: its replica died before answering (%s); sending it again "
                                   "(attempt %d of %d)", request_id, type(err).__name__, attempt + 1, self.max_attempts)
                except asyncio.CancelledError:
                    stream.cancel()  # closes the replica's generator: it aborts the request
                    raise
        except asyncio.CancelledError:
            raise
        except Exception as err:
            sink.put_nowait((tag, _cause(err)))
        finally:
            if not answered:
                self._num_unanswered -= 1
            self._tasks.pop(request_id, None)


def _cause(err: Exception) -> Exception:
    """The replica's own exception (a RequestError is a 400) rather than Ray's wrapper of it."""
    if isinstance(err, RayTaskError) and isinstance(err.cause, Exception):
        return err.cause
    return err
