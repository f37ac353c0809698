"""A fleet simulation: 64 replicas x 10,000 adapters, our adapter-affinity routing against Serve's default.

    PYTHONHASHSEED=0 .venv/bin/python -m benchmarks.fleet_sim [--phases steady-0.8,hotspot] [--jobs 2]

(The hash seed makes a run repeat exactly: Ray's router and the engine's LoRA budget break some ties in set order.)

A discrete-event simulation in pure Python. The routers are the real classes, driven as Serve drives them
(benchmarks/fleet_routers.py): ours is deployments.routing.policy.AffinityPolicy, which our Serve
RequestRouter (deployments/routing/router.py) is a thin shell around; Serve's default is Ray 2.60's own
PowerOfTwoChoicesRequestRouter. Replicas (benchmarks/fleet_replica.py) are modelled by their adapter loads,
admission (the engine's own LoRABudget and admission order: benchmarks/fleet_admission.py) and step costs: 64
replicas of an accelerator-sized replica (NPU_COSTS: assumed, see there) x 10,000 adapters, Zipf 0.8 / 1.0 / 1.2,
drift and hot-spot phases, each also served as a single adapter (the TTFT p99 baseline).
benchmarks/fleet_validate.py runs this simulation at the real fleet benchmark's size, against a recorded run of it;
benchmarks/fleet_admission_ab.py takes the admission rule apart where the TTFT p99 bound was missed (at 0.5 ms a
distinct adapter); benchmarks/fleet_costs.py runs the bound over that cost.
Arrivals and lengths: the Azure LLM inference trace 2023 (benchmarks/fleet_workload.py, TRACE_CITATION).
Writes results/fleet_sim.json and results/fleet_sim.md.
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

from benchmarks.common import command, record
from benchmarks.fleet_admission import MAX_WAIT_STEPS
from benchmarks.fleet_cpu import SharedCpu
from benchmarks.fleet_replica import Replica, ReplicaSpec, SimRequest, StepCosts
from benchmarks.fleet_routers import AffinityRouting, ServeDefaultRouting
from benchmarks.fleet_sim_metrics import TICK_S, metrics
from benchmarks.fleet_waits import markdown as waits_markdown
from benchmarks.fleet_workload import TRACE_CITATION, Phase, adapter_names, make_workload

ROUTERS = {"adapter-affinity": AffinityRouting, "serve-default": ServeDefaultRouting}
# An accelerator-sized replica (one NPU, an 8B model in bf16, rank-16 adapters on all seven projections, ~87 MB
# each). Assumed, not measured here: a decode step of 20 ms + 0.25 ms per sequence + 0.2 ms per distinct adapter,
# prefill at 10k tokens/s, a slot copy of 87 MB at ~20 GB/s, a read of 87 MB from local NVMe plus validation in
# 0.1 s. The same linear form as the calibration measured on the demo model. The per-adapter term is the LoRA
# kernel's: our Ascend backend runs one shrink and one expand launch per projection and layer for all of a step's
# adapters (lora/backends/ascend.py), so a distinct adapter adds the reading of its weights; 0.2 ms is the largest
# of three estimates of that: its 88.6 MB at ~1.6 TB/s of device memory (0.055 ms), Punica's measured ~2 ms a token
# for 32 distinct adapters on a 7B model (MLSys'24, ~0.06 ms each), our CPU engine's own fit (per adapter 0.83 % of
# the base step, results/fleet_calibration.json: 0.17 ms of 20 ms). benchmarks/fleet_costs.py runs the bound over
# 0.05-0.5 ms (0.5 ms, a launch per adapter, projection and layer, was this model's first assumption).
# 32 slots (2.8 GB of device memory): with 8, a replica's ~25 requests in flight over as many adapters starve on
# the LoRA budget under either router (TTFT p99 > 40 s in a first run).
NPU_COSTS = StepCosts(base_s=0.020, per_seq_s=0.00025, per_adapter_s=0.0002, per_prefill_token_s=0.0001,
                      slot_load_s=0.005, disk_load_s=0.1)
NPU_SPEC = ReplicaSpec(max_num_seqs=64, max_loras_per_batch=32, max_loaded_loras=256, max_num_batched_tokens=2048,
                       max_ongoing_requests=128)


@dataclass(frozen=True)
class Scenario:
    replicas: int
    num_adapters: int
    rate: float
    duration_s: float
    warmup_s: float
    spec: ReplicaSpec
    cores: float | None = None      # steps and serving paths share this many cores (fleet_cpu.py); None: a device each
    path_s: float = 0.0             # the serving path before a request reaches its engine (with `cores`: CPU work)
    background_jobs: float = 0.0    # with `cores`: other processes' runnable threads, sharing the cores too
    path_latency_s: float = 0.0     # the rest of the serving path, waiting rather than working
    path_before_routing: float = 0.0   # the share of `path_s` done before the router chooses (proxy, ingress)
    replica_cores: float | None = None  # with `cores`: each replica's steps on a quota of their own (fleet.py
    #                                     --replica-cpus), the paths and the background on the `cores` left
    lengths: tuple = ()             # make_workload's length arguments, as (name, value) pairs


FLEET_SCENARIO = Scenario(replicas=64, num_adapters=10_000, rate=192.0, duration_s=60.0, warmup_s=120.0,
                          spec=NPU_SPEC, lengths=(("prompt_scale", 1.0), ("output_scale", 1.0),
                                                  ("max_prompt", 4096), ("max_output", 1024)))
PHASES = {"steady-0.8": Phase("steady", 0.8), "steady-1.0": Phase("steady", 1.0), "steady-1.2": Phase("steady", 1.2),
          "drift": Phase("drift", 1.0), "hotspot": Phase("hotspot", 1.0)}


class Simulation:
    def __init__(self, scenario: Scenario, costs: StepCosts, router: str, seed: int = 0, options=()):
        self.scenario, self.now = scenario, 0.0
        self.replicas = [Replica(i, scenario.spec, costs) for i in range(scenario.replicas)]
        self.router = ROUTERS[router](self.replicas, lambda: self.now, seed=seed,
                                      adapters=adapter_names(scenario.num_adapters), **dict(options))
        self.events: list = []
        self._order = itertools.count()
        self.samples: list[list[int]] = []     # in-flight per replica, every TICK_S
        self.cold_loads: list[float] = []      # when each cold load started
        self.cpu = (SharedCpu(scenario.cores, lambda: self.now, self.at, scenario.background_jobs) if scenario.cores
                    else None)
        self.replica_cpus = [SharedCpu(scenario.replica_cores, lambda: self.now, self.at) for _ in self.replicas] \
            if scenario.cores and scenario.replica_cores else None

    def set_costs(self, costs: StepCosts, path_s: float, path_latency_s: float, background_jobs: float) -> None:
        """Costs from now on (benchmarks/fleet_validate.py: each replayed run has its own machine load)."""
        for replica in self.replicas:
            replica.costs = costs
        self.scenario = replace(self.scenario, path_s=path_s, path_latency_s=path_latency_s,
                                background_jobs=background_jobs)
        self.cpu.set_background(background_jobs)

    def at(self, t: float, handler, *args) -> None:
        heapq.heappush(self.events, (t, next(self._order), handler, args))

    def run(self, requests: list[SimRequest]) -> list[SimRequest]:
        for req in requests:
            self.at(req.at, self.arrive, req)
        end = requests[-1].at if requests else 0.0
        self.at(0.0, self.tick, end)
        while self.events:
            self.now, _, handler, args = heapq.heappop(self.events)
            handler(*args)
        return requests

    def tick(self, end: float) -> None:
        self.samples.append([r.in_flight for r in self.replicas])
        self.router.tick(self.now)
        for replica, adapter, victims in getattr(self.router, "prefetch_targets", lambda now: [])(self.now):
            load = replica.prefetch(adapter, victims)
            if load is not None:
                self.start_load(replica, load)
        if self.now < end or any(r.in_flight for r in self.replicas):
            self.at(self.now + TICK_S, self.tick, end)

    def arrive(self, req: SimRequest) -> None:
        self.after(self.scenario.path_s * self.scenario.path_before_routing, self.route, req)

    def route(self, req: SimRequest) -> None:
        req.attempts += 1
        chosen = self.router.select(self.router.tiers(req))
        if chosen is None:
            self.at(self.now + self.router.retry_in(req.attempts), self.route, req)
            return
        replica = self.replicas[chosen]
        replica.in_flight += 1            # what Serve counts from the send on (the path included)
        req.replica, req.routed_at = chosen, self.now
        self.router.routed(req)
        self.after(self.scenario.path_s * (1 - self.scenario.path_before_routing), self.travel, replica, req)

    def after(self, work_s: float, handler, *args) -> None:
        """`handler(*args)` once `work_s` of work is done: on the shared cores, else on a device of its own."""
        if self.cpu is not None:
            self.cpu.start(work_s, handler, *args)
        else:
            self.at(self.now + work_s, handler, *args)

    def travel(self, replica: Replica, req: SimRequest) -> None:
        self.at(self.now + self.scenario.path_latency_s, self.reach, replica, req)

    def reach(self, replica: Replica, req: SimRequest) -> None:
        replica.in_flight -= 1
        load = replica.arrive(req, self.now)
        if load is not None:
            self.start_load(replica, load)
        self.maybe_step(replica)

    def start_load(self, replica: Replica, adapter: str) -> None:
        self.cold_loads.append(self.now)
        self.at(self.now + replica.costs.disk_load_s, self.loaded, replica, adapter)

    def loaded(self, replica: Replica, adapter: str) -> None:
        following = replica.loaded(adapter, self.now)
        if following is not None:
            self.start_load(replica, following)
        self.maybe_step(replica)

    def maybe_step(self, replica: Replica) -> None:
        if replica.busy or not replica.has_work():
            return
        if self.replica_cpus:
            self.replica_cpus[replica.index].start(replica.start_step(self.now), self.step_done, replica)
        else:
            self.after(replica.start_step(self.now), self.step_done, replica)

    def step_done(self, replica: Replica) -> None:
        for req in replica.end_step(self.now):
            self.router.completed(req)
        self.maybe_step(replica)


def requests_for(scenario: Scenario, phase: Phase, seed: int, single_adapter: bool = False) -> list[SimRequest]:
    duration = scenario.warmup_s + scenario.duration_s
    if phase.name == "hotspot":
        phase = replace(phase, hotspot_at_s=scenario.warmup_s + phase.hotspot_at_s)
    return [SimRequest(r.at, "single" if single_adapter else r.adapter, r.prompt_tokens, r.output_tokens)
            for r in make_workload(num_adapters=scenario.num_adapters, rate=scenario.rate, duration_s=duration,
                                   phase=phase, seed=seed, **dict(scenario.lengths))]


def simulate(scenario: Scenario, costs: StepCosts, router: str, phase: Phase, seed: int = 0,
             single_adapter: bool = False, options: tuple = ()) -> dict:
    """options: (name, value) pairs for our router (AffinityPolicy's knobs, prefetch_fill)."""
    requests = requests_for(scenario, phase, seed, single_adapter)
    started = time.process_time()
    sim = Simulation(scenario, costs, router, seed, options if router == "adapter-affinity" else ())
    sim.run(requests)
    result = metrics(sim, requests, phase)
    result["cpu_s"] = time.process_time() - started
    return result


def phase_row(case: tuple) -> dict:
    """(costs, phase name, router, seed) -> its simulate() result with the single-adapter fleet's TTFT p99 beside."""
    costs, name, router, seed = case
    phase = PHASES[name]
    result = simulate(FLEET_SCENARIO, costs, router, phase, seed)
    single = simulate(FLEET_SCENARIO, costs, router, phase, seed, single_adapter=True)
    result["single_adapter_ttft_p99_s"] = single["ttft_p99_s"]
    result["ttft_p99_over_single"] = result["ttft_p99_s"] / single["ttft_p99_s"]
    result["cpu_s"] += single["cpu_s"]
    result["single_adapter_waits"] = single["waits"]
    return result


def run_fleet(costs: StepCosts, phases: list[str], seed: int, jobs: int = 1) -> dict:
    """Each (phase, router) with its single-adapter baseline; `jobs` of them side by side (one core each)."""
    cases = [(costs, name, router, seed) for name in phases for router in ROUTERS]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(phase_row, cases))
    rows = {}
    for (_, name, router, _), result in zip(cases, results):
        rows[f"{name} {router}"] = result
        print(name, router, json.dumps({k: round(v, 3) for k, v in result.items() if "waits" not in k}), flush=True)
    return rows


ACCEPT = (("hit_rate", ">=", 0.95), ("imbalance_p99", "<=", 1.2), ("cold_loads_per_replica_s", "<=", 0.5),
          ("hotspot_max_over_mean", "<=", 1.5), ("ttft_p99_over_single", "<=", 1.25))


def markdown(result: dict) -> str:
    cols = ("hit_rate", "cold_loads_per_replica_s", "ttft_p50_s", "ttft_p99_s", "single_adapter_ttft_p99_s",
            "ttft_p99_over_single", "tpot_p50_s", "output_tok_s", "imbalance_p99", "hotspot_max_over_mean",
            "distinct_adapters_per_step", "lost")
    lines = [f"### Fleet simulation: {FLEET_SCENARIO.replicas} replicas x {FLEET_SCENARIO.num_adapters:,} adapters",
             "", f"`{result.get('command', 'python -m benchmarks.fleet_sim')}`; arrivals and lengths: "
             + TRACE_CITATION + f", {FLEET_SCENARIO.rate:g} req/s, "
             f"{FLEET_SCENARIO.warmup_s:g} s warm-up then {FLEET_SCENARIO.duration_s:g} s measured per phase; "
             "replica costs NPU_COSTS (assumed, fleet_sim.py), spec " + json.dumps(asdict(NPU_SPEC)) + "; admission: "
             f"the engine's LoRABudget, lora_max_wait_steps {MAX_WAIT_STEPS} (fleet_admission.py).", "",
             "| phase / router | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for key, row in result["fleet"].items():
        cells = []
        for col in cols:
            value = row.get(col)
            mark = ""
            for metric, op, bound in ACCEPT:
                if metric == col and value is not None:
                    ok = value >= bound if op == ">=" else value <= bound
                    mark = "" if ok else " ✗"
            cells.append("" if value is None else f"{value:.3g}{mark}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += ["", "✗: misses the acceptance bound (hit rate >= 0.95, imbalance <= 1.2, <= 0.5 cold loads per replica "
              "per second, hot-spot max / mean <= 1.5, TTFT p99 <= 1.25x the same fleet serving one adapter)."]
    lines += waits_markdown(result["fleet"])
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="simulations run side by side (one core each)")
    args = parser.parse_args(argv)
    started = time.process_time()
    result = {"what": __doc__.split("\n\n")[0], "trace": TRACE_CITATION, "scenario": asdict(FLEET_SCENARIO),
              "npu_costs": asdict(NPU_COSTS), "command": command("benchmarks.fleet_sim", argv)}
    result["fleet"] = run_fleet(NPU_COSTS, args.phases.split(","), args.seed, args.jobs)
    return record("fleet_sim", result, started, markdown)


if __name__ == "__main__":
    main()
