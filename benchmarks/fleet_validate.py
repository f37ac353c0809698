"""The fleet simulation against the real fleet: a recorded run of benchmarks/fleet.py replayed in the simulation
(benchmarks/fleet_sim.py) at its exact size, and the hit rate and TTFT p50 of every run predicted (issue 37, 4).

    .venv/bin/python -m benchmarks.fleet_validate [--real benchmarks/results/fleet_validation_real.json ...]

The same fleet (the run's FleetSpec: replicas, adapters, max_num_seqs, max_loaded_loras, max_loras_per_batch,
max_ongoing_requests; the engine's CPU token budget) and the same requests (benchmarks/fleet.py `workloads`: each
run's warm-up, then its timed arrivals and lengths from the trace), each routing's runs in the recorded order on
one simulated fleet (an application kept its state from run to run), its replicas starting as the real ones do
(every configured adapter read at start: the host cache holds the last `max_loaded_loras` of them). Routers: ours
is AffinityPolicy itself, with its replicas' home prefetch; Serve's default is Ray's own router
(benchmarks/fleet_routers.py). What is calibrated, from what (never from the predicted numbers):
- the engine's step costs: results/fleet_calibration.json (one engine stepped directly, the fastest of repeats);
- the serving work outside the engine: results/fleet_path_cpu.json (benchmarks/fleet_path_cpu.py: CPU seconds of
  every process of a Ray session serving lone requests): per request, less its prefill step, the CPU work of its
  path before the engine; per further token, less a decode step, work added to the step that gives the token;
- the cores: steps and paths share `--cores` (this machine's 2) as processor sharing (benchmarks/fleet_cpu.py); a
  run on replicas with CPU quotas (fleet.py --replica-cpus) steps each replica on its quota, the paths on the rest
  with `background` runnable jobs (Ray, the other application, other users), fitted per run until its simulated
  TPOT p50 is the real one (the runs alternate on a machine that others share: each has its own load);
- what of a lone request's path is waiting rather than work: the median TTFT of the runs' first requests (the
  fleet idle since the warm-up) less a prefill step, less the path's work stretched by the background.
Predicted: each run's host-cache hit rate and TTFT p50 (the mean of `--seeds` simulations) and their relative
error against the real run (the issue's bound: 15 %); beside them, TTFT p99, the TTFT p50 of the requests that
found their replica idle (nothing else in flight there: from the request records) and the share served by the
adapter's hash-first replica. Writes results/<--out>.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import OrderedDict
from pathlib import Path

from benchmarks.common import RESULTS, write_result
from benchmarks.fleet_calibration import calibrated_costs
from benchmarks.fleet_replica import ReplicaSpec, SimRequest, StepCosts
from benchmarks.fleet_sim import Scenario, Simulation
from benchmarks.fleet_sim_metrics import percentile
from benchmarks.fleet_validation_report import markdown
from benchmarks.fleet_workload import FleetSpec, adapter_names
from deployments.routing.prefetch import bounded_homes

ROUTERS = {"multiplex": "serve-default", "adapter-affinity": "adapter-affinity"}
SETTLE_S = 3.5      # fleet.py: the warm-up's last answers, then SETTLE_S before the timed arrivals
BETWEEN_RUNS_S = 60.0   # an application idle while the other one runs


def idle_arrivals(spans: list[tuple[str, float, float, float]]) -> list[float]:
    """TTFTs of the requests that found nothing else in flight on their replica: (replica, sent, first, end)."""
    out = []
    for i, (replica, sent, first, _) in enumerate(spans):
        if not any(j != i and r == replica and s < sent < e for j, (r, s, _, e) in enumerate(spans)):
            out.append(first - sent)
    return out


def real_spans(records: list[dict]) -> list[tuple[str, float, float, float]]:
    return [(r["replica"], r["sent"], r["first"], r["end"]) for r in records if r["outcome"] == "ok"]


def sim_spans(requests: list[SimRequest]) -> list[tuple[str, float, float, float]]:
    return [(str(r.replica), r.at, r.first_token_at, r.finished_at) for r in requests]


def tpots(requests: list[SimRequest]) -> list[float]:
    return [(r.finished_at - r.first_token_at) / (r.output_tokens - 1) for r in requests if r.output_tokens > 1]


def sim_metrics(requests: list[SimRequest], replicas: int) -> dict:
    ttft = [r.first_token_at - r.at for r in requests]
    ids = [str(i) for i in range(replicas)]
    homes = bounded_homes(sorted({r.adapter for r in requests}), ids)
    home = sum(str(r.replica) == homes[r.adapter] for r in requests) / len(requests)
    return {"hit_rate": sum(r.hit for r in requests) / len(requests), "ttft_p50_ms": 1e3 * percentile(ttft, 50),
            "ttft_p99_ms": 1e3 * percentile(ttft, 99), "tpot_p50_ms": 1e3 * percentile(tpots(requests), 50),
            "idle_ttft_p50_ms": 1e3 * percentile(idle_arrivals(sim_spans(requests)), 50), "home_share": home}


def spec_of(fleet: FleetSpec, max_num_batched_tokens: int) -> ReplicaSpec:
    return ReplicaSpec(max_num_seqs=fleet.max_num_seqs, max_loras_per_batch=fleet.max_loras_per_batch,
                       max_loaded_loras=fleet.max_loaded_loras, max_num_batched_tokens=max_num_batched_tokens,
                       max_ongoing_requests=fleet.max_ongoing_requests)


class Replay:
    """Every plain run of a recorded fleet.py result, per routing in the recorded order on one simulated fleet."""

    def __init__(self, real: dict, cores: float, max_num_batched_tokens: int, path_cpu_s: float,
                 before_routing: float, replica_cores: float | None = None):
        from benchmarks.fleet import SETTINGS, workloads

        self.fleet = FleetSpec(**real["fleet"])
        self.spec = spec_of(self.fleet, max_num_batched_tokens)
        self.cores, self.path_cpu_s, self.before_routing = cores, path_cpu_s, before_routing
        self.replica_cores = replica_cores
        self.floor_s = 0.0   # a lone request's path on this run's machine: path_floor()
        self.runs = [(i, r["setting"], r["routing"]) for i, r in enumerate(real["runs"]) if r["routing"] in ROUTERS]
        self.requests: dict[int, tuple[list, list]] = {}
        for i, setting, _ in self.runs:
            index = list(SETTINGS).index(setting)
            self.requests[i] = workloads(SETTINGS[setting], index, self.fleet, real["duration_s"])

    def path_latency(self, background: float) -> float:
        """What a lone request's path (`floor_s`, with the background alone on the cores) spent waiting rather than
        working: the rest of it."""
        return max(0.0, self.floor_s - self.path_cpu_s * max(1.0, (1 + background) / self.cores))

    def simulate(self, costs: StepCosts, background: dict[int, float], seed: int, options: tuple = (),
                 windows: dict | None = None) -> dict[int, list]:
        """Run index -> its timed SimRequests, simulated; the `background` jobs per run; `options`: our router's
        knobs (fleet_sim.simulate's); `windows`, if given, gets run index -> (its simulation, timed start, end)."""
        out = {}
        for routing, router in ROUTERS.items():
            scenario = Scenario(replicas=self.fleet.replicas, num_adapters=self.fleet.num_adapters,
                                rate=self.fleet.rate, duration_s=0.0, warmup_s=0.0, spec=self.spec, cores=self.cores,
                                path_before_routing=self.before_routing, replica_cores=self.replica_cores)
            sim = Simulation(scenario, costs, router, seed, options if router == "adapter-affinity" else ())
            configured = adapter_names(self.fleet.num_adapters)[-self.spec.max_loaded_loras:]
            for replica in sim.replicas:
                replica.host = OrderedDict.fromkeys(configured)
            everything, t = [], 0.0
            for i, _, run_routing in self.runs:
                if run_routing != routing:
                    continue
                warm, timed = self.requests[i]
                sim.at(t, sim.set_costs, costs, self.path_cpu_s, self.path_latency(background[i]), background[i])
                everything += [SimRequest(t + r.at, r.adapter, r.prompt_tokens, r.output_tokens) for r in warm]
                t += warm[-1].at + 1.0 + SETTLE_S   # the warm-up's last answer, then fleet.py's settle
                out[i] = [SimRequest(t + r.at, r.adapter, r.prompt_tokens, r.output_tokens) for r in timed]
                everything += out[i]
                if windows is not None:
                    windows[i] = (sim, t, t + timed[-1].at)
                t += timed[-1].at + BETWEEN_RUNS_S
            everything.sort(key=lambda r: r.at)
            sim.run(everything)
        return out


def serving_costs(engine: StepCosts, probe: dict) -> tuple[StepCosts, float]:
    """The engine's step costs plus the serving work per token, and the path's CPU work per request, from
    fleet_path_cpu's lone requests: their CPU per further token less a decode step of one, per request less the
    step that prefilled its 8 tokens."""
    per_token = probe["cpu_s_per_further_token"] - engine.step_s(1, 1, 0, 0)
    path = probe["cpu_s_per_request"] - engine.step_s(1, 1, 8, 0)
    return dataclasses.replace(engine, per_token_s=max(0.0, per_token)), max(0.0, path)


def path_floor(replay: Replay, records: dict[int, list], base: StepCosts) -> float:
    """The serving path with nothing else in flight: the median over runs of the TTFT of each run's first request
    (the fleet idle since the warm-up) minus its prefill step (with its slot copy) at the calibrated cost."""
    floors = []
    for i, _, _ in replay.runs:
        first = min((r for r in records[i] if r["outcome"] == "ok"), key=lambda r: r["sent"])
        prompt = replay.requests[i][1][0].prompt_tokens
        floors.append(first["first"] - first["sent"] - base.step_s(1, 1, prompt, 1))
    return statistics.median(floors)


FITS = {"tpot": "tpot_p50_s", "idle-ttft": "idle_ttft_p50_s"}


def calibrate(replay: Replay, records: dict[int, list], costs: StepCosts, fit: str, seed: int,
              rounds: int = 14) -> tuple:
    """Per run, the background jobs such that its simulated `fit` (FITS: TPOT p50, or the TTFT p50 of idle-replica
    arrivals) is the real one (a run's machine load is its own: the runs alternate on a machine that others
    share), bisected, every run in each round. Returns the last round's background, the targets and what it
    simulated."""
    runs = [i for i, _, _ in replay.runs]
    target = {i: {"tpot_p50_s": percentile([1e-3 * t for t in real_tpots(records[i])], 50),
                  "idle_ttft_p50_s": percentile(idle_arrivals(real_spans(records[i])), 50)} for i in runs}
    brackets = {i: [0.0, 8.0] for i in runs}
    for _ in range(rounds):
        background = {i: sum(brackets[i]) / 2 for i in runs}
        got = replay.simulate(costs, background, seed)
        fitted = {i: simulated_targets(got[i]) for i in runs}
        for i in runs:
            brackets[i][fitted[i][FITS[fit]] > target[i][FITS[fit]]] = background[i]
    return background, target, fitted


def simulated_targets(requests: list[SimRequest]) -> dict:
    return {"tpot_p50_s": percentile(tpots(requests), 50),
            "idle_ttft_p50_s": percentile(idle_arrivals(sim_spans(requests)), 50)}


def real_tpots(records: list[dict]) -> list[float]:
    return [1e3 * (r["last"] - r["first"]) / (r["tokens"] - 1) for r in records
            if r["outcome"] == "ok" and r["tokens"] > 1]


def relative_error(predicted: float, real: float) -> float:
    return (predicted - real) / real


def compare(real: dict, records: dict[int, list], predicted: list[dict[int, list]]) -> list[dict]:
    """One row per replayed run: real, predicted (mean over seeds) and relative error of hit rate and TTFT p50."""
    rows = []
    for i in sorted(predicted[0]):
        run = real["runs"][i]
        per_seed = [sim_metrics(p[i], real["fleet"]["replicas"]) for p in predicted]
        sim = {k: statistics.fmean(m[k] for m in per_seed) for k in per_seed[0]}
        summary = run["summary"]
        actual = {"hit_rate": summary["host_hit_rate"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
                  "ttft_p99_ms": summary["ttft_ms"]["p99"], "tpot_p50_ms": summary["tpot_ms"]["p50"],
                  "idle_ttft_p50_ms": 1e3 * percentile(idle_arrivals(real_spans(records[i])), 50),
                  "home_share": summary["placement"]["served_at_hash_rank"][0]}
        rows.append({"run": i + 1, "setting": run["setting"], "routing": run["routing"], "real": actual,
                     "predicted": sim, "seed_range": {k: [min(m[k] for m in per_seed), max(m[k] for m in per_seed)]
                                                      for k in ("hit_rate", "ttft_p50_ms")},
                     "error": {k: relative_error(sim[k], actual[k]) for k in actual}})
    return rows


def find_records(real: dict) -> Path:
    """The request records fleet.py wrote for this run: .cache/fleet/records-<start, epoch seconds>.json."""
    import calendar
    import time

    from deployments.demo_model import default_cache_dir

    start = calendar.timegm(time.strptime(real["started"], "%Y-%m-%d %H:%M UTC"))
    found = [p for p in (default_cache_dir() / "fleet").glob("records-*.json")
             if start <= int(p.stem.split("-")[1]) < start + 60]
    if len(found) != 1:
        raise SystemExit(f"no single request-records file for the run started {real['started']}: pass --records")
    return found[0]


def validate(real_path: Path, probe: dict, cores: float, seeds: int, before_routing: float) -> dict:
    real = json.loads(real_path.read_text())
    records_path = find_records(real)
    records = {i: run["records"] for i, run in enumerate(json.loads(records_path.read_text()))}
    calibration = json.loads((RESULTS / "fleet_calibration.json").read_text())
    engine = calibrated_costs()
    costs, path_cpu_s = serving_costs(engine, probe)
    # a run whose replicas had CPU quotas (fleet.py --replica-cpus): their steps on those, the rest on the cores left
    replica_cores = real.get("replica_cpus")
    if replica_cores:
        cores -= real["fleet"]["replicas"] * replica_cores
    replay = Replay(real, cores, calibration["engine"]["max_num_batched_tokens"], path_cpu_s, before_routing,
                    replica_cores)
    replay.floor_s = path_floor(replay, records, engine)
    fits = {}
    for fit in FITS:
        background, targets, fitted = calibrate(replay, records, costs, fit, seed=0)
        predicted = [replay.simulate(costs, background, seed) for seed in range(seeds)]
        fits[fit] = {"background_jobs": {str(i): b for i, b in background.items()},
                     "path_latency_s": {str(i): replay.path_latency(b) for i, b in background.items()},
                     "calibration_targets": {str(i): t for i, t in targets.items()},
                     "calibration_fitted": {str(i): f for i, f in fitted.items()},
                     "rows": compare(real, records, predicted)}
    return {"real_path": str(real_path.resolve().relative_to(RESULTS.parent.parent)), "real_started": real["started"],
            "records": str(records_path), "replicas": replay.fleet.replicas, "num_adapters": replay.fleet.num_adapters,
            "duration_s": real["duration_s"], "cores": cores, "replica_cores": replica_cores, "seeds": seeds,
            "engine_costs": dataclasses.asdict(engine), "costs": dataclasses.asdict(costs), "path_cpu_s": path_cpu_s,
            "path_floor_s": replay.floor_s, "path_before_routing": before_routing, "fits": fits}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, nargs="+", default=[RESULTS / "fleet_validation_real.json"],
                        help="recorded fleet.py results (their request records are found under .cache/fleet)")
    parser.add_argument("--path-cpu", type=Path, default=RESULTS / "fleet_path_cpu.json",
                        help="benchmarks/fleet_path_cpu.py's measurement")
    parser.add_argument("--cores", type=float, default=2.0)
    parser.add_argument("--path-before-routing", type=float, default=0.0,
                        help="the share of the path's work done before the router chooses (proxy, ingress; not "
                             "measured: 0 counts a request in flight at its replica for all of it)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="fleet_validation")
    args = parser.parse_args(argv)
    probe = json.loads(args.path_cpu.read_text())
    command = "python -m benchmarks.fleet_validate " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"what": __doc__.split("\n\n")[0], "command": command, "path_cpu_probe": probe,
              "validations": [validate(path, probe, args.cores, args.seeds, args.path_before_routing)
                              for path in args.real]}
    print(write_result(args.out, result))
    text = f"`{command}`\n\n" + "\n".join(markdown(v) for v in result["validations"])
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
