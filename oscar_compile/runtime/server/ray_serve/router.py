"""Prefix-affinity routing: a request goes to the replica that served the longest prefix it shares.

Why our own router. A prompt resent, or a follow-up sharing all but its tail, runs 5-72x faster on
the replica that cached its prefix (README, "Prefix-cache hits"), and on no other. Ray Serve's
default router (power of two choices) spreads such requests at random; Ray Serve LLM's
``PrefixCacheAffinityRouter`` matches the characters of ``.prompt`` / ``.messages``, so a token-id
prompt gets no affinity, and importing it loads ``ray.serve.llm`` (pyarrow, a vLLM pin).

How. The ingress sends each prompt's ``PrefixKeys`` (prefix_keys.py: chained hashes at the
engine's snapshot boundaries) as the ``prefix_keys`` keyword of the replica call.
``choose_replicas`` looks the keys up longest first in a table of which replica last served each
prefix, and ranks that replica first. When its queue (requests this router has in flight there)
exceeds the shortest by more than ``imbalance_threshold``, affinity yields to load: two random
candidates, the shorter queue first (power of two choices), as for a request without keys.
``on_request_routed`` records every key of the request under the replica it went to.

Hits and misses (``ROUTING_COUNTS``, read by the ingress's ``/metrics``): a hit is a request
routed to the replica its longest known prefix named; a miss, one with keys that went elsewhere
(no prefix known, the owner gone, or the queues uneven). The router runs in the process of the
handle that calls the replicas (the ingress), so a module-level counter is what the ingress reads.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from oscar_compile.runtime.server.ray_serve.prefix_keys import PrefixKeys

DEFAULT_IMBALANCE_THRESHOLD = 8  # requests; below a replica's batch, so affinity holds under load
DEFAULT_MAX_KEYS = 1 << 20  # table entries (16-byte keys): LRU beyond


@dataclass
class RoutingCounts:
    """Requests with prefix keys routed to the replica their prefix named (hits) or elsewhere
    (misses); ``num_imbalanced``: misses because the queues were uneven past the threshold."""

    num_hits: int = 0
    num_misses: int = 0
    num_imbalanced: int = 0


ROUTING_COUNTS = RoutingCounts()


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD,
                         max_keys: int = DEFAULT_MAX_KEYS, **kwargs) -> None:
        if imbalance_threshold < 0 or max_keys < 1:
            raise ValueError(f"imbalance_threshold must be >= 0 and max_keys >= 1, "
                             f"got {imbalance_threshold} and {max_keys}")
        self.imbalance_threshold = imbalance_threshold
        self.max_keys = max_keys
        self._owners: OrderedDict[bytes, ReplicaID] = OrderedDict()  # prefix key -> replica, LRU last
        self._preferred: dict[str, ReplicaID | None] = {}  # internal request id -> the owner it was ranked to
        self._imbalanced: set[str] = set()
        self._num_ongoing: dict[ReplicaID, int] = {}  # this router's requests in flight, per replica
        # Ray may ship this class by value: the module's counter is the one the ingress reads
        from oscar_compile.runtime.server.ray_serve import router as module

        self.counts = module.ROUTING_COUNTS

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        keys = _keys_of(pending_request)
        spread = self._two_choices(candidate_replicas)
        if keys is None:
            return [spread]
        request_id = pending_request.metadata.internal_request_id
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner = self._longest_owner(keys, by_id)
        self._imbalanced.discard(request_id)
        if owner is not None and self._is_uneven(owner, candidate_replicas):
            self._imbalanced.add(request_id)
            owner = None
        self._preferred[request_id] = owner
        if owner is None:
            return [spread]
        # the owner first; if it turns the request down (queue full), the others as usual
        return [[by_id[owner]], [r for r in spread if r.replica_id != owner]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._num_ongoing[replica_id] = self._num_ongoing.get(replica_id, 0) + 1
        keys = _keys_of(pending_request)
        if keys is None:
            return
        request_id = pending_request.metadata.internal_request_id
        preferred = self._preferred.pop(request_id, None)
        if preferred is not None and preferred == replica_id:
            self.counts.num_hits += 1
        else:
            self.counts.num_misses += 1
            if request_id in self._imbalanced:
                self.counts.num_imbalanced += 1
        self._imbalanced.discard(request_id)
        for key in keys.keys:
            self._owners[key] = replica_id
            self._owners.move_to_end(key)
        while len(self._owners) > self.max_keys:
            self._owners.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._num_ongoing.get(replica_id, 0) > 0:
            self._num_ongoing[replica_id] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._num_ongoing.pop(replica_id, None)  # its prefixes go stale: the owner is no candidate

    # ---- helpers -----------------------------------------------------------------------------
    def _longest_owner(self, keys: PrefixKeys, candidates: dict[ReplicaID, RunningReplica]) -> ReplicaID | None:
        for key in reversed(keys.keys):
            owner = self._owners.get(key)
            if owner is not None and owner in candidates:
                return owner
        return None

    def _queue(self, replica_id: ReplicaID) -> int:
        return self._num_ongoing.get(replica_id, 0)

    def _is_uneven(self, owner: ReplicaID, candidates: list[RunningReplica]) -> bool:
        shortest = min(self._queue(r.replica_id) for r in candidates)
        return self._queue(owner) - shortest > self.imbalance_threshold

    def _two_choices(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        """Two random candidates (or the one), the shorter queue first: the base router probes
        them and takes the first that accepts."""
        picked = random.sample(candidates, min(2, len(candidates)))
        return sorted(picked, key=lambda r: self._queue(r.replica_id))


def _keys_of(pending_request: PendingRequest | None) -> PrefixKeys | None:
    if pending_request is None:
        return None
    keys = pending_request.kwargs.get("prefix_keys")
    return keys if isinstance(keys, PrefixKeys) and keys.keys else None
