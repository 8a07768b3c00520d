"""The prefix-affinity router's choices, without a cluster: the longest known prefix wins, uneven
queues fall back to two random choices, and every routed request with keys is a hit or a miss."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve.request_router")

from oscar_compile.runtime.server.ray_serve.prefix_keys import prefix_keys  # noqa: E402
from oscar_compile.runtime.server.ray_serve.router import PrefixAffinityRouter, RoutingCounts  # noqa: E402

DOC_A = list(range(100, 1124))
DOC_B = list(range(2000, 3024))


def _router(threshold: int = 2) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the routing state only: no Ray Serve around it
    router.initialize_state(imbalance_threshold=threshold)
    router.counts = RoutingCounts()
    return router


def _request(n: int, prompt: list[int]):
    keys = prefix_keys(prompt, 256, 16)
    return SimpleNamespace(kwargs={"prefix_keys": keys}, metadata=SimpleNamespace(internal_request_id=f"r{n}"))


def _route(router, replicas, n: int, prompt: list[int]) -> str:
    """Route one request as Ray Serve would: the first replica of the first rank."""
    request = _request(n, prompt)
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    chosen = ranks[0][0] if len(ranks[0]) == 1 else min(ranks[0], key=lambda r: router._queue(r.replica_id))
    router.on_request_routed(request, chosen.replica_id, None)
    return chosen.replica_id


def test_follow_ups_go_where_their_document_went():
    router = _router(threshold=100)
    replicas = [SimpleNamespace(replica_id=f"replica-{i}") for i in range(3)]
    first_a = _route(router, replicas, 0, DOC_A + [1, 2])
    first_b = _route(router, replicas, 1, DOC_B + [1, 2])
    for n in range(2, 8):
        assert _route(router, replicas, n, DOC_A + [n, n]) == first_a
        assert _route(router, replicas, 100 + n, DOC_B + [n]) == first_b
    # a prompt sharing only DOC_A's first 600 tokens resumes at 512: it goes there too
    assert _route(router, replicas, 50, DOC_A[:600] + [7] * 500) == first_a
    assert (router.counts.num_hits, router.counts.num_misses) == (13, 2)


def test_uneven_queues_fall_back_to_the_least_loaded():
    router = _router(threshold=2)
    replicas = [SimpleNamespace(replica_id=f"replica-{i}") for i in range(2)]
    owner = _route(router, replicas, 0, DOC_A + [1])
    for n in range(1, 3):  # nothing completes: the owner's queue grows to 3, the threshold past 0
        assert _route(router, replicas, n, DOC_A + [n]) == owner
    other = _route(router, replicas, 9, DOC_A + [9])
    assert other != owner and router.counts.num_imbalanced == 1
    # the document is now on both; the table names the replica that served it last
    assert _route(router, replicas, 10, DOC_A + [10]) == other
    assert router.counts.num_hits == 3 and router.counts.num_misses == 2
