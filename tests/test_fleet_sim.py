"""The fleet simulation's invariants (benchmarks/fleet_sim.py): nothing lost, load accounted for, and the cases whose
answer is known by hand (one replica at low load: a request's TTFT is its load plus one prefill step)."""
from __future__ import annotations

import heapq
import itertools
import random

import pytest

from benchmarks.fleet_admission import MAX_WAIT_STEPS
from benchmarks.fleet_cpu import SharedCpu
from benchmarks.fleet_replica import Replica, ReplicaSpec, SimRequest, StepCosts
from benchmarks.fleet_sim import Scenario, Simulation
from benchmarks.fleet_validate import idle_arrivals

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


def step_alone(spec: ReplicaSpec, requests: list[SimRequest]) -> tuple[Replica, list[dict]]:
    """One replica, its adapters in host memory, stepped until empty; steps take one unit of time each. Returns
    it and, per step: the adapters paused, the requests given a token, the running requests."""
    replica = Replica(0, spec, COSTS)
    replica.host.update(dict.fromkeys(r.adapter for r in requests))
    for req in requests:
        assert replica.arrive(req, 0.0) is None
    steps = []
    while replica.has_work():
        replica.start_step(float(len(steps)))
        assert len(replica.engine.active_adapters()) <= spec.max_loras_per_batch
        steps.append({"paused": {r.adapter for r in replica.engine.running if replica.engine.budget.is_paused(r)},
                      "tokens": replica._decodes + [r for r, _ in replica._chunks if r.prefill_left == 0],
                      "running": len(replica.engine.running)})
        replica.end_step(float(len(steps)))
    assert replica.in_flight == 0 and not replica.uses and not replica.queued and not replica.engine.running
    return replica, steps


def test_a_third_adapter_over_a_budget_of_two_starts_within_the_rotation_bound_and_nothing_is_lost():
    """The engine's LoRABudget admits (fleet_admission.py): the third adapter waits max_wait_steps, then takes the
    place of the holder that entered last, which sits out; first come first served would keep it waiting for a
    whole 40-token generation (its first token at step 41)."""
    requests = [SimRequest(0.0, f"a{i}", 8, 40) for i in range(3)]
    _, steps = step_alone(SPEC, requests)   # a budget of 2 adapters
    assert requests[2].first_token_at <= 2 * MAX_WAIT_STEPS + 1
    assert any(step["paused"] for step in steps)
    tokens = [req for step in steps for req in step["tokens"]]
    assert all(tokens.count(r) == r.output_tokens and r.finished_at >= 0 for r in requests)   # every token once


def test_a_paused_holder_keeps_its_place_and_gives_no_tokens():
    """Two places, a budget of one adapter: the rotation pauses a holder for the waiter; the paused one keeps its
    place (a third adapter starts only when a request ends) and gives no token while paused."""
    spec = ReplicaSpec(max_num_seqs=2, max_loras_per_batch=1, max_loaded_loras=4, max_num_batched_tokens=64,
                       max_ongoing_requests=16)
    requests = [SimRequest(0.0, f"a{i}", 8, 30) for i in range(3)]
    _, steps = step_alone(spec, requests)
    assert any(step["paused"] for step in steps)
    for step in steps:
        assert step["running"] <= spec.max_num_seqs
        assert not {r.adapter for r in step["tokens"]} & step["paused"]
    assert requests[2].admitted_at >= min(requests[0].finished_at, requests[1].finished_at)


def test_the_token_budget_chunks_a_long_prompt():
    requests = [SimRequest(0.0, "a0", 150, 2)]
    run(1, requests)
    steps = [COSTS.step_s(1, 1, 64, 1), COSTS.step_s(1, 1, 64, 0), COSTS.step_s(1, 1, 22, 0)]
    assert requests[0].first_token_at == pytest.approx(COSTS.disk_load_s + sum(steps))


@pytest.mark.parametrize("cores, finished", [(1.0, {"a": 1.5, "b": 2.0}), (2.0, {"a": 1.0, "b": 1.5})])
def test_shared_cores_run_each_job_at_its_share(cores, finished):
    """One core: a runs alone for 0.5 s, then a and b at half speed each (a ends at 1.5), then b alone (2.0).
    Two cores: each its own."""
    events, now, order, done = [], [0.0], itertools.count(), {}

    def schedule(t, handler, *args):
        heapq.heappush(events, (t, next(order), handler, args))

    cpu = SharedCpu(cores, lambda: now[0], schedule)
    schedule(0.0, cpu.start, 1.0, lambda: done.setdefault("a", now[0]))
    schedule(0.5, cpu.start, 1.0, lambda: done.setdefault("b", now[0]))
    while events:
        now[0], _, handler, args = heapq.heappop(events)
        handler(*args)
    assert done == pytest.approx(finished)


def test_shared_cores_stretch_a_simulated_step_by_the_steps_beside_it():
    alone = SimRequest(0.0, "a0", 8, 2)
    run(1, [alone])
    requests = [SimRequest(0.0, f"a{i}", 8, 2) for i in range(2)]
    sim = Simulation(Scenario(replicas=2, num_adapters=0, rate=0.0, duration_s=0.0, warmup_s=0.0, spec=SPEC,
                              cores=1.0), COSTS, "serve-default")
    sim.run(requests)
    assert {r.replica for r in requests} == {0, 1}
    steps = alone.finished_at - COSTS.disk_load_s   # the cold load is a read, not CPU work
    assert all(r.finished_at == pytest.approx(COSTS.disk_load_s + 2 * steps) for r in requests)


def test_prefetch_makes_room_only_from_its_victims():
    replica = Replica(0, ReplicaSpec(max_num_seqs=8, max_loras_per_batch=2, max_loaded_loras=2,
                                     max_num_batched_tokens=64, max_ongoing_requests=16), COSTS)
    replica.host.update(dict.fromkeys(["a", "b"]))
    assert replica.prefetch("c", frozenset({"x"})) is None and list(replica.host) == ["a", "b"]
    assert replica.prefetch("c", frozenset({"b"})) == "c" and list(replica.host) == ["a"]
    replica.loaded("c", 0.0)
    assert list(replica.host) == ["a", "c"]


def test_idle_arrivals_are_those_with_nothing_else_in_flight_on_their_replica():
    spans = [("x", 0.0, 0.1, 1.0), ("x", 0.5, 0.7, 0.8), ("y", 0.5, 0.55, 0.6), ("x", 1.5, 1.6, 1.7)]
    assert idle_arrivals(spans) == pytest.approx([0.1, 0.05, 0.1])


def test_the_serving_path_is_work_on_the_shared_cores_split_at_the_routing_decision():
    """A lone request: routed after its share of the path before routing, at its engine after the rest and the
    path's waiting; its first token one prefill step later (cold: after the read)."""
    spec = Scenario(replicas=1, num_adapters=0, rate=0.0, duration_s=0.0, warmup_s=0.0, spec=SPEC, cores=2.0,
                    path_s=0.02, path_latency_s=0.005, path_before_routing=0.25)
    request = SimRequest(1.0, "a0", 8, 2)
    Simulation(spec, COSTS, "adapter-affinity").run([request])
    assert request.routed_at == pytest.approx(1.005)
    assert request.first_token_at == pytest.approx(1.0 + 0.02 + 0.005 + COSTS.disk_load_s + COSTS.step_s(1, 1, 8, 1))


def test_replicas_with_cpu_quotas_step_on_their_own_share_not_on_the_idle_cores():
    """Two requests on one replica of a 2-replica fleet: with 2 shared cores each step runs at a full core; on quotas
    of 0.5 core each it takes twice as long, whatever the other replica's quota leaves idle."""
    finished = {}
    for quota in (None, 0.5):
        requests = [SimRequest(0.0, "a0", 8, 3), SimRequest(0.0, "a0", 8, 3)]
        sim = Simulation(Scenario(replicas=2, num_adapters=0, rate=0.0, duration_s=0.0, warmup_s=0.0, spec=SPEC,
                                  cores=2.0, replica_cores=quota), COSTS, "adapter-affinity")
        sim.run(requests)
        assert {r.replica for r in requests} == {requests[0].replica}   # both at the adapter's home
        finished[quota] = requests[0].finished_at - COSTS.disk_load_s   # the read is not CPU work
    assert finished[0.5] == pytest.approx(2 * finished[None])
