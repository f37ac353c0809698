"""The LLMServer's request router on Ray Serve's public router API: adapter affinity (policy.py).

Serve runs one router per caller process (the ingress replica, a proxy, each DeploymentHandle owner);
each drives its own AffinityPolicy. The policy's inputs:
- replicas' `record_routing_stats` (LLMServer.record_routing_stats: residency and load, every
  `request_routing_stats_period_s`), read on every replica-set broadcast;
- what this router sent: `on_request_routed` (accepted by a replica) and `on_request_completed`.
`choose_replicas` returns the policy's ranking as one replica per tier, so Serve tries them in order
and moves to the next at once when a replica is at `max_ongoing_requests` (no backoff in between).
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.routing.policy import AffinityPolicy


class AdapterAffinityRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        """`RequestRouterConfig.request_router_kwargs`: AffinityPolicy's knobs (LLMConfig.routing_options)."""
        self.policy = AffinityPolicy(**kwargs)
        self._requests: dict[str, tuple[str | None, str]] = {}   # internal request id -> (adapter, replica)

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
                               lora_budget=stats.get("lora_budget"))

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is None:   # Serve asks without a request to warm up: any replica
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True   # every replica full: back off, then retry
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = self.policy.rank(pending_request.metadata.multiplexed_model_id or None)
        return [[by_id[r]] for r in ranked if r in by_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        adapter = pending_request.metadata.multiplexed_model_id or None
        self._requests[pending_request.metadata.internal_request_id] = (adapter, replica_id.unique_id)
        self.policy.routed(adapter, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        entry = self._requests.get(internal_request_id)
        # a rejected try's completion may come after the retry was accepted elsewhere: match the replica
        if entry is not None and entry[1] == replica_id.unique_id:
            del self._requests[internal_request_id]
            self.policy.completed(*entry)
