"""PrefixAffinityRouter: a Ray Serve request router that sends a prompt to the replica holding its prefix.

Each replica's engine keeps finished sequences in its prefix cache (``prefix_cache.py``): a prompt sharing a prefix
with one (a conversation's earlier turns, a common system prompt) prefills only the rest, but only on the replica
that holds it. The router remembers, per block of ``block_tokens`` prompt tokens (a chain of hashes, so a block
stands for the whole prefix up to it), the replica it last sent that prefix to, and::

    owner = replica of the longest remembered prefix of the prompt (among the replicas up)
    if owner and in_flight[owner] <= min(in_flight) + imbalance:  rank owner first
    else:                                                         rank the least loaded first (ties at random)
    then the other replicas, least loaded first (Ray tries the next rank when one is full)

``in_flight`` counts this router's requests ranked first for each replica and not yet completed (counted when
chosen, so that requests routed together see each other). The prompt's blocks are then remembered for the replica
ranked first (the one the request goes to unless it is full). Requests are the
``EngineRequest`` of ``EngineReplica.generate`` (token ids); any other call (``facts``) goes to the least loaded.
It is Ray Serve's ``RequestRouter`` API (``ray.serve.request_router``), configured by ``request_router_kwargs``
(``block_tokens``, ``imbalance``, ``max_blocks``). Each ingress replica routes with its own table.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .ray_messages import EngineRequest


def prefix_blocks(tokens: Sequence[int], block_tokens: int) -> list[int]:
    """The hash of each whole block of ``tokens``, chained: the k-th stands for ``tokens[:(k + 1) * block_tokens]``."""
    hashes: list[int] = []
    chained = 0
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        chained = hash((chained, tuple(tokens[end - block_tokens:end])))
        hashes.append(chained)
    return hashes


class PrefixAffinityRouter(RequestRouter):
    """Prefix-cache affinity with a load bound (see the module doc)."""

    def initialize_state(self, block_tokens: int = 16, imbalance: int = 4, max_blocks: int = 100_000) -> None:
        if block_tokens < 1 or imbalance < 0 or max_blocks < 1:
            raise ValueError(f"PrefixAffinityRouter needs block_tokens >= 1, imbalance >= 0, max_blocks >= 1; got "
                             f"{block_tokens}, {imbalance}, {max_blocks}")
        self._block_tokens = block_tokens
        self._imbalance = imbalance
        self._max_blocks = max_blocks
        self._owner: OrderedDict[int, ReplicaID] = OrderedDict()  # prefix block hash -> replica, least recent first
        self._in_flight: dict[ReplicaID, int] = {}
        self._counted: dict[str, ReplicaID] = {}  # a request's internal id -> the replica it is counted on

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        load = {r.replica_id: self._in_flight.get(r.replica_id, 0) for r in candidate_replicas}
        by_load = sorted(candidate_replicas, key=lambda r: (load[r.replica_id], random.random()))
        blocks = self._blocks(pending_request)
        owner = self._owner_of(blocks, load)
        first = by_load[0]
        if owner is not None and load[owner] <= load[first.replica_id] + self._imbalance:
            first = next(r for r in candidate_replicas if r.replica_id == owner)
        self._remember(blocks, first.replica_id)
        if pending_request is not None:
            self._count(pending_request.metadata.internal_request_id, first.replica_id)
        return [[first]] + [[r] for r in by_load if r.replica_id != first.replica_id]

    def _blocks(self, pending_request: PendingRequest | None) -> list[int]:
        if pending_request is None:
            return []
        for arg in pending_request.args:
            if isinstance(arg, EngineRequest) and arg.prompts:
                return prefix_blocks(arg.prompts[0], self._block_tokens)
        return []

    def _owner_of(self, blocks: list[int], replicas_up: dict[ReplicaID, int]) -> ReplicaID | None:
        """The replica of the longest remembered prefix among ``blocks``, if it is up."""
        for block in reversed(blocks):
            owner = self._owner.get(block)
            if owner is not None and owner in replicas_up:
                return owner
        return None

    def _remember(self, blocks: list[int], replica: ReplicaID) -> None:
        for block in blocks:
            self._owner[block] = replica
            self._owner.move_to_end(block)
        while len(self._owner) > self._max_blocks:
            self._owner.popitem(last=False)

    def _count(self, request: str, replica: ReplicaID) -> None:
        self._uncount(request)  # (chosen again: a retry)
        self._counted[request] = replica
        self._in_flight[replica] = self._in_flight.get(replica, 0) + 1

    def _uncount(self, request: str) -> None:
        replica = self._counted.pop(request, None)
        if replica is not None and replica in self._in_flight:
            self._in_flight[replica] = max(0, self._in_flight[replica] - 1)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._uncount(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._in_flight.pop(replica_id, None)
        for block in [b for b, owner in self._owner.items() if owner == replica_id]:
            del self._owner[block]
