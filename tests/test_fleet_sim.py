"""The fleet simulation's invariants (benchmarks/fleet_sim.py): nothing lost, load accounted for, and the cases whose
answer is known by hand (one replica at low load: a request's TTFT is its load plus one prefill step)."""
from __future__ import annotations

import random

import pytest

from benchmarks.fleet_replica import ReplicaSpec, SimRequest, StepCosts
from benchmarks.fleet_sim import Scenario, Simulation

COSTS = StepCosts(base_s=0.010, per_seq_s=0.001, per_adapter_s=0.002, per_prefill_token_s=0.0001, slot_load_s=0.005,
                  disk_load_s=0.05)
SPEC = ReplicaSpec(max_num_seqs=8, max_loras_per_batch=2, max_loaded_loras=4, max_num_batched_tokens=64,
                   max_ongoing_requests=16)


def scenario(replicas: int, spec: ReplicaSpec = SPEC) -> Scenario:
    return Scenario(replicas=replicas, num_adapters=0, rate=0.0, duration_s=0.0, warmup_s=0.0, spec=spec)


def run(replicas: int, requests: list[SimRequest], router: str = "adapter-affinity", spec: ReplicaSpec = SPEC):
    sim = Simulation(scenario(replicas, spec), COSTS, router)
    sim.run(requests)
    return sim


def random_requests(count: int, adapters: int, rate: float, seed: int = 0) -> list[SimRequest]:
    rng, at, out = random.Random(seed), 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        out.append(SimRequest(at, f"a{min(adapters - 1, int(rng.paretovariate(1.0)) - 1)}", rng.randint(4, 100),
                              rng.randint(1, 30)))
    return out


@pytest.mark.parametrize("router", ["adapter-affinity", "serve-default"])
def test_every_request_finishes_once_and_the_fleet_ends_empty(router):
    requests = random_requests(400, adapters=12, rate=40.0)
    sim = run(4, requests, router)
    assert all(r.at <= r.routed_at <= r.first_token_at <= r.finished_at for r in requests)
    assert all(0 <= r.replica < 4 for r in requests)
    for replica in sim.replicas:   # conservation: what arrived left; no adapter is still held by a request
        assert replica.in_flight == 0 and not replica.has_work() and not replica.uses and not replica.queued
        assert not replica.blocked
        assert len(replica.slots) <= SPEC.max_loras_per_batch   # (the host cache may grow while all of it is in use)
    # a miss starts at most one load per (replica, adapter) at a time, and every load comes from a miss
    assert sum(x.cold_loads for x in sim.replicas) <= sum(not r.hit for r in requests)
    assert max(max(s) for s in sim.samples) <= SPEC.max_ongoing_requests


def test_driving_rays_router_leaves_its_module_as_it_was():
    """The baseline steps Ray's router on the simulation's clock; after it, Serve still builds a deployment config
    (the patched clock once broke pickling its router class in the rest of the test process)."""
    from ray.serve._private.request_router import request_router
    from ray.serve.config import RequestRouterConfig

    before = request_router.time
    run(2, random_requests(20, adapters=3, rate=20.0), "serve-default")
    assert request_router.time is before
    RequestRouterConfig()


def test_one_replica_at_low_load_ttft_is_load_plus_prefill_and_tpot_is_a_decode_step():
    requests = [SimRequest(10.0 * i, "a0", 40, 5) for i in range(3)]
    run(1, requests)
    cold, warm = requests[0], requests[1]
    assert not cold.hit and warm.hit and requests[2].hit
    prefill_cold = COSTS.step_s(seqs=1, adapters=1, prefill_tokens=40, slot_loads=1)
    assert cold.first_token_at - cold.at == pytest.approx(COSTS.disk_load_s + prefill_cold)
    assert warm.first_token_at - warm.at == pytest.approx(COSTS.step_s(1, 1, 40, 0))   # still in its slot
    decode = COSTS.step_s(seqs=1, adapters=1, prefill_tokens=0, slot_loads=0)
    assert (warm.finished_at - warm.first_token_at) / 4 == pytest.approx(decode)


def test_a_request_outside_the_lora_budget_waits_for_the_holder_to_finish():
    spec = ReplicaSpec(max_num_seqs=8, max_loras_per_batch=1, max_loaded_loras=4, max_num_batched_tokens=64,
                       max_ongoing_requests=16)
    first, second = SimRequest(0.0, "a0", 8, 10), SimRequest(0.0, "a1", 8, 10)
    run(1, [first, second], spec=spec)
    assert second.first_token_at > first.finished_at


def test_the_token_budget_chunks_a_long_prompt():
    requests = [SimRequest(0.0, "a0", 150, 2)]
    run(1, requests)
    steps = [COSTS.step_s(1, 1, 64, 1), COSTS.step_s(1, 1, 64, 0), COSTS.step_s(1, 1, 22, 0)]
    assert requests[0].first_token_at == pytest.approx(COSTS.disk_load_s + sum(steps))
