"""One ``/metrics`` for the application: every replica's metrics with a ``replica`` label, the
router's hits and misses, and the ingress's ignored request fields.

Why merged at the ingress: a Prometheus scraper sees one endpoint (the one clients use); it cannot
reach replicas, which serve no HTTP of their own. The ingress asks every replica at once
(``DeploymentHandle.broadcast``) and merges their families: samples keep their names and labels,
plus ``replica="<id>"``, so a sum over ``replica`` gives the application's total.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from oscar_compile.runtime.server.ray_serve.router import RoutingCounts


def merge_replica_metrics(replicas: Iterable[tuple[str, bytes | str]], routing: RoutingCounts, num_resent: int = 0,
                          ingress: bytes | str = b"", ingress_families: tuple[str, ...] = ()) -> bytes:
    """The exposition of every replica's families with a ``replica`` label, the router's counts,
    the requests the ingress sent again (``num_resent``) and the families named
    ``ingress_families`` of the ingress's own text."""
    registry = CollectorRegistry()
    registry.register(_Merged(list(replicas), routing, num_resent, _text(ingress), ingress_families))
    return generate_latest(registry)


def _text(payload: bytes | str) -> str:
    return payload.decode() if isinstance(payload, bytes) else payload


class _Merged:
    def __init__(self, replicas: list[tuple[str, bytes | str]], routing: RoutingCounts, num_resent: int,
                 ingress: str, ingress_families: tuple[str, ...]):
        self._replicas, self._routing, self._num_resent = replicas, routing, num_resent
        self._ingress, self._ingress_families = ingress, ingress_families

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for replica_id, text in self._replicas:
            for family in text_string_to_metric_families(_text(text)):
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    out.add_sample(s.name, {**s.labels, "replica": replica_id}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
        for family in text_string_to_metric_families(self._ingress):
            if family.name in self._ingress_families:
                yield family
        for name, help_text, value in (
                ("oscar_router_prefix_hits", "Requests routed to the replica that served their longest known "
                 "prefix.", self._routing.num_hits),
                ("oscar_router_prefix_misses", "Requests with prefix keys routed elsewhere (no known prefix, its "
                 "replica gone, or the queues uneven).", self._routing.num_misses),
                ("oscar_router_prefix_imbalanced", "Misses because the preferred replica's queue exceeded the "
                 "shortest by more than the imbalance threshold.", self._routing.num_imbalanced),
                ("oscar_ingress_resent_requests", "Requests sent again because their replica died before "
                 "answering.", self._num_resent)):
            yield CounterMetricFamily(name, help_text, value=value)
