"""The Serve request router's shell around the policy (deployments/routing/router.py), driven outside a cluster as
Serve drives it (benchmarks/fleet_routers.py drives Ray's own router the same way): a failure inside the policy
routes the request to any replica instead of ending Serve's routing task, which left the request pending for good."""
from __future__ import annotations

import asyncio

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve._private.request_router.common import PendingRequest

from benchmarks.fleet_routers import _RunningReplica
from deployments.routing.router import AdapterAffinityRouter


def choose(replicas: int, break_policy: bool = False):
    """A router over `replicas` replicas (Serve calls it on its event loop): its policy and the tiers it returns."""
    async def run():
        deployment = DeploymentID(name="LLMServer", app_name="shell")
        router = AdapterAffinityRouter(deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        running = [_RunningReplica(ReplicaID(unique_id=f"r{i}", deployment_id=deployment), 8, lambda: 0)
                   for i in range(replicas)]
        router.update_replicas(running)
        if break_policy:
            def broken(adapter):
                raise ValueError("min() arg is an empty sequence")
            router.policy.rank = broken
        metadata = RequestMetadata(request_id="q", internal_request_id="q", multiplexed_model_id="a")
        return router.policy, running, await router.choose_replicas(running, PendingRequest([], {}, metadata))
    return asyncio.run(run())


def test_the_policys_ranking_comes_back_one_replica_per_tier():
    policy, _, tiers = choose(3)
    assert all(len(t) == 1 for t in tiers)
    assert [t[0].replica_id.unique_id for t in tiers] == [r for r in policy.order("a")]   # idle: hash order


def test_a_failing_policy_routes_the_request_to_any_replica(caplog):
    with caplog.at_level("ERROR", logger="ray.serve"):
        _, running, tiers = choose(3, break_policy=True)
    assert tiers == [running]
    assert "adapter-affinity routing failed for adapter 'a'" in caplog.text
