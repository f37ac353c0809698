"""The LLMServer's request router on Ray Serve's public router API: adapter affinity (policy.py).

Serve runs one router per caller process (the ingress replica, a proxy, each DeploymentHandle owner);
each drives its own AffinityPolicy. The policy's inputs:
- replicas' `record_routing_stats` (LLMServer.record_routing_stats: residency and load, every
  `request_routing_stats_period_s`), read on every replica-set broadcast;
- what this router sent: its first choice for a request counts at once (Serve asks for the choices of a
  burst's requests before any replica accepted the first: counted only at `on_request_routed`, a burst of
  12 saw every replica idle and went to one), moved if another replica accepted it (`on_request_routed`),
  and ends at `on_request_completed`.
`choose_replicas` returns the policy's ranking as one replica per tier, so Serve tries them in order
and moves to the next at once when a replica is at `max_ongoing_requests` (no backoff in between).
"""
from __future__ import annotations

import logging
import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.routing.policy import AffinityPolicy

logger = logging.getLogger("ray.serve")


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        """`RequestRouterConfig.request_router_kwargs`: AffinityPolicy's knobs (LLMConfig.routing_options)."""
        self.policy = AffinityPolicy(**kwargs)
        self._requests: dict[str, tuple[str | None, str]] = {}   # internal request id -> (adapter, replica)
        self._chosen: dict[str, tuple[str | None, str, float]] = {}   # not yet accepted: (adapter, replica, when)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.set_replicas(r.replica_id.unique_id for r in replicas)
        for r in replicas:
            stats = r.routing_stats or {}
            # Serve's own list of the adapters a replica holds arrives every 0.1 s, before its next stats
            host = set(stats.get("host", ())) | set(r.multiplexed_model_ids)
            self.policy.report(r.replica_id.unique_id, capacity=stats.get("capacity") or r.max_ongoing_requests,
                               load=stats.get("load"), device=stats.get("device", ()), host=host,
                               loading=stats.get("loading", ()), evicts_next=stats.get("evicts_next"),
                               lora_budget=stats.get("lora_budget"), host_slots=stats.get("host_slots"),
                               homes=stats.get("homes"))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is None:   # Serve asks without a request to warm up: any replica
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True   # every replica full: back off, then retry
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        adapter = pending_request.metadata.multiplexed_model_id or None
        try:
            ranked = [r for r in self.policy.rank(adapter) if r in by_id]
        except Exception:   # noqa: BLE001  it would end Serve's routing task and leave the request pending, unrouted
            logger.exception("adapter-affinity routing failed for adapter %r: any replica this time", adapter)
            return [candidate_replicas]
        self._forget_choice(pending_request.metadata.internal_request_id)   # a retry chooses again
        self._expire_choices()
        if ranked:
            self._chosen[pending_request.metadata.internal_request_id] = (adapter, ranked[0], time.monotonic())
            self.policy.routed(adapter, ranked[0])
        return [[by_id[r]] for r in ranked]

    def _forget_choice(self, request_id: str) -> None:
        entry = self._chosen.pop(request_id, None)
        if entry is not None:
            self.policy.completed(entry[0], entry[1])

    def _expire_choices(self, ttl_s: float = 30.0) -> None:
        """A request no replica ever accepted (its caller gave up while Serve backed off) stops counting."""
        now = time.monotonic()
        for request_id in [i for i, (_, _, t) in self._chosen.items() if now - t > ttl_s]:
            self._forget_choice(request_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        adapter = pending_request.metadata.multiplexed_model_id or None
        self._requests[request_id] = (adapter, replica_id.unique_id)
        chosen = self._chosen.pop(request_id, None)
        if chosen is not None and chosen[1] == replica_id.unique_id:
            return                                       # counted when chosen
        if chosen is not None:
            self.policy.completed(chosen[0], chosen[1])
        self.policy.routed(adapter, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        entry = self._requests.get(internal_request_id)
        # a rejected try's completion may come after the retry was accepted elsewhere: match the replica
        if entry is not None and entry[1] == replica_id.unique_id:
            del self._requests[internal_request_id]
            self.policy.completed(*entry)
