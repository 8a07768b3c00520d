"""The ingress deployment and the application graph: today's FastAPI app in front of N engine replicas.

The ingress asks one replica for the engine's limits (``EngineLimits``), then builds the
single-process server's app (``create_app``) over a ``RemoteEngine``: the same routes, request
checks, error bodies, API key and limits, each request validated once, here, before a replica sees
it. Its ``/metrics`` is the application's (metrics.py). ``build_application`` binds the two
deployments: replicas with ``max_ongoing_requests`` = the engine's ``max_num_seqs`` (Ray Serve's
default of 5 would cap each replica's batch at 5) and, unless asked otherwise, the
prefix-affinity router.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import Response
from ray import serve
from ray.serve.config import RequestRouterConfig

from oscar_compile.runtime.server.app import create_app
from oscar_compile.runtime.server.metrics import CONTENT_TYPE
from oscar_compile.runtime.server.ray_serve.metrics import merge_replica_metrics
from oscar_compile.runtime.server.ray_serve.remote_engine import DEFAULT_MAX_ATTEMPTS, RemoteEngine
from oscar_compile.runtime.server.ray_serve.replica import EngineReplica
from oscar_compile.runtime.server.ray_serve.router import (
    DEFAULT_IMBALANCE_THRESHOLD,
    ROUTING_COUNTS,
    PrefixAffinityRouter,
)
from oscar_compile.runtime.server.server_config import ServerConfig

logger = logging.getLogger(__name__)
_METRICS_TIMEOUT_S = 10.0
_INGRESS_FAMILIES = ("oscar_ignored_request_fields",)  # what only the ingress counts


class Ingress:
    """The HTTP entry of the application (wrapped by ``serve.ingress()`` in ``build_application``)."""

    async def __init__(self, replicas, model_names: Sequence[str], config: ServerConfig,
                       max_attempts: int = DEFAULT_MAX_ATTEMPTS):
        self._replicas = replicas
        limits = await replicas.describe.remote()
        self.remote_engine = RemoteEngine(replicas, limits, max_attempts)
        self.fastapi_app = create_app(self.remote_engine, list(model_names), config)
        _replace_route(self.fastapi_app, "/metrics", self.metrics)

    def __serve_build_asgi_app__(self):
        return self.fastapi_app

    async def metrics(self):
        results = await self._replicas.broadcast("metrics").results_async(
            timeout_s=_METRICS_TIMEOUT_S, return_exceptions=True)
        answered = [r for r in results if not isinstance(r, BaseException)]
        for err in (r for r in results if isinstance(r, BaseException)):
            logger.warning("a replica did not report its metrics: %s", err)
        totals: dict[str, float] = {}
        for _, _, stats in answered:
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        self.remote_engine.stats.update(totals)
        body = merge_replica_metrics(((rid, text) for rid, text, _ in answered), ROUTING_COUNTS,
                                     self.remote_engine.num_retries, self.fastapi_app.state.metrics.render(),
                                     _INGRESS_FAMILIES)
        return Response(body, media_type=CONTENT_TYPE)


def _replace_route(app, path: str, endpoint: Callable) -> None:
    """Serve ``path`` with ``endpoint`` in place of the app's own (its GET route)."""
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != path]
    app.get(path)(endpoint)


@dataclass(frozen=True)
class ReplicaPlacement:
    """What each replica holds on its node: ``num_gpus`` (the tensor-parallel size on a GPU, 0 on
    CPU) and ``num_cpus`` (fractional on a small machine)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0


def build_application(make_engine: Callable[[], tuple[Any, Any]], model_names: Sequence[str],
                      config: ServerConfig, *, num_replicas: int, max_num_seqs: int,
                      placement: ReplicaPlacement = ReplicaPlacement(),
                      router: Literal["prefix", "default"] = "prefix",
                      imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                      max_attempts: int = DEFAULT_MAX_ATTEMPTS):
    """The Ray Serve application (to ``serve.run``): the ingress over ``num_replicas`` replicas.
    ``router``: ``"prefix"`` (PrefixAffinityRouter) or ``"default"`` (Ray Serve's power of two
    choices, the baseline the bench compares with)."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if router == "prefix":
        router_config = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                            request_router_kwargs={"imbalance_threshold": imbalance_threshold})
    elif router == "default":
        router_config = RequestRouterConfig()
    else:
        raise ValueError(f"router must be 'prefix' or 'default', got {router!r}")
    replicas = serve.deployment(EngineReplica, name="engine").options(
        num_replicas=num_replicas, max_ongoing_requests=max_num_seqs, request_router_config=router_config,
        ray_actor_options={"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus},
    ).bind(make_engine, model_names[0])
    # the ingress holds every open request: no cap below the admission queue's
    waiting = config.max_waiting_requests or 1024
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress").options(
        num_replicas=1, max_ongoing_requests=waiting + num_replicas * max_num_seqs,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replicas, list(model_names), config, max_attempts)
