"""The fleet simulation against the real fleet: a recorded run of benchmarks/fleet.py replayed in the simulation
(benchmarks/fleet_sim.py) at its exact size, and the hit rate and TTFT p50 of every run predicted (issue 37, 4).

    .venv/bin/python -m benchmarks.fleet_validate [--real results/fleet_validation_real.json] [--records PATH]

The same fleet (the run's FleetSpec: replicas, adapters, max_num_seqs, max_loaded_loras, max_loras_per_batch,
max_ongoing_requests; the engine's CPU token budget) and the same requests (benchmarks/fleet.py `workloads`: each
run's warm-up, then its timed arrivals and lengths from the trace), each routing's runs in the recorded order on
one simulated fleet (an application kept its state from run to run), its replicas starting as the real ones do
(every configured adapter read at start: the host cache holds the last `max_loaded_loras` of them). Routers: ours
is AffinityPolicy itself, with its replicas' home prefetch; Serve's default is Ray's own router
(benchmarks/fleet_routers.py). What is calibrated, from what (never from the predicted numbers):
- the engine's step costs: results/fleet_calibration.json (one engine stepped directly, the fastest of repeats);
- the cores: the replicas share `--cores` (this machine's 2), a step stretched by busy replicas / cores;
- `per_token_s`, the serving work of each streamed token outside the engine (the replica's streaming, Serve's
  handle, ingress, proxy, client, and whatever else ran on the machine): bisected per setting until the
  simulated TPOT p50 of the setting's runs (both routings pooled) is the real one;
- `path_s`, the serving path of a request: the real TTFT p50 of the requests that found their replica idle
  (nothing else in flight there, from the request records) minus the simulated one, per setting, pooled.
Predicted: each run's host-cache hit rate and TTFT p50 (the mean of `--seeds` simulations), and their relative
error against the real run (the issue's bound: 15 %). Writes results/fleet_validation.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections import OrderedDict
from pathlib import Path

from benchmarks.common import RESULTS, write_result
from benchmarks.fleet_calibration import calibrated_costs
from benchmarks.fleet_replica import ReplicaSpec, SimRequest, StepCosts
from benchmarks.fleet_sim import Scenario, Simulation, percentile
from benchmarks.fleet_workload import FleetSpec, adapter_names

ROUTERS = {"multiplex": "serve-default", "adapter-affinity": "adapter-affinity"}
SETTLE_S = 3.5      # fleet.py: the warm-up's last answers, then SETTLE_S before the timed arrivals
BETWEEN_RUNS_S = 60.0   # an application idle while the other one runs
BOUND = 0.15


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


def sim_metrics(requests: list[SimRequest]) -> dict:
    ttft = [r.first_token_at - r.at for r in requests]
    return {"hit_rate": sum(r.hit for r in requests) / len(requests), "ttft_p50_ms": 1e3 * percentile(ttft, 50),
            "ttft_p99_ms": 1e3 * percentile(ttft, 99), "tpot_p50_ms": 1e3 * percentile(tpots(requests), 50)}


def spec_of(fleet: FleetSpec, max_num_batched_tokens: int) -> ReplicaSpec:
    return ReplicaSpec(max_num_seqs=fleet.max_num_seqs, max_loras_per_batch=fleet.max_loras_per_batch,
                       max_loaded_loras=fleet.max_loaded_loras, max_num_batched_tokens=max_num_batched_tokens,
                       max_ongoing_requests=fleet.max_ongoing_requests)


class Replay:
    """Every plain run of a recorded fleet.py result, per routing in the recorded order on one simulated fleet."""

    def __init__(self, real: dict, cores: float, max_num_batched_tokens: int):
        from benchmarks.fleet import SETTINGS, workloads

        self.fleet = FleetSpec(**real["fleet"])
        self.spec = spec_of(self.fleet, max_num_batched_tokens)
        self.cores = cores
        self.runs = [(i, r["setting"], r["routing"]) for i, r in enumerate(real["runs"]) if r["routing"] in ROUTERS]
        self.requests: dict[int, tuple[list, list]] = {}
        for i, setting, _ in self.runs:
            index = list(SETTINGS).index(setting)
            self.requests[i] = workloads(SETTINGS[setting], index, self.fleet, real["duration_s"])

    def simulate(self, costs: dict[int, StepCosts], paths: dict[int, float], seed: int) -> dict[int, list]:
        """Run index -> its timed SimRequests, simulated; `costs` and `paths` per run."""
        out = {}
        for routing, router in ROUTERS.items():
            scenario = Scenario(replicas=self.fleet.replicas, num_adapters=self.fleet.num_adapters,
                                rate=self.fleet.rate, duration_s=0.0, warmup_s=0.0, spec=self.spec, cores=self.cores)
            first = next(iter(costs.values()))
            sim = Simulation(scenario, first, router, seed)
            configured = adapter_names(self.fleet.num_adapters)[-self.spec.max_loaded_loras:]
            for replica in sim.replicas:
                replica.host = OrderedDict.fromkeys(configured)
            everything, t = [], 0.0
            for i, _, run_routing in self.runs:
                if run_routing != routing:
                    continue
                warm, timed = self.requests[i]
                sim.at(t, sim.set_costs, costs[i], paths[i])
                everything += [SimRequest(t + r.at, r.adapter, r.prompt_tokens, r.output_tokens) for r in warm]
                t += warm[-1].at + 1.0 + SETTLE_S   # the warm-up's last answer, then fleet.py's settle
                out[i] = [SimRequest(t + r.at, r.adapter, r.prompt_tokens, r.output_tokens) for r in timed]
                everything += out[i]
                t += timed[-1].at + BETWEEN_RUNS_S
            everything.sort(key=lambda r: r.at)
            sim.run(everything)
        return out


def calibrate(replay: Replay, records: dict[int, list], base: StepCosts, seed: int, rounds: int = 16) -> tuple:
    """Per run, per_token_s and path_s (CPU seconds) such that its simulated TPOT p50 and idle-arrival TTFT p50
    are the real ones: both bisected at once, every run in each round (a run's machine load is its own: the runs
    alternate on a machine that others share). Returns (costs, paths, targets, what the last round simulated)."""
    runs = [i for i, _, _ in replay.runs]
    target = {i: {"tpot_p50_s": percentile([1e-3 * t for t in real_tpots(records[i])], 50),
                  "idle_ttft_p50_s": percentile(idle_arrivals(real_spans(records[i])), 50)} for i in runs}
    brackets = {i: {"per_token_s": [0.0, 0.01], "path_s": [0.0, 0.2]} for i in runs}
    for _ in range(rounds):
        mid = {i: {k: sum(b) / 2 for k, b in brackets[i].items()} for i in runs}
        got = replay.simulate({i: dataclasses.replace(base, per_token_s=mid[i]["per_token_s"]) for i in runs},
                              {i: mid[i]["path_s"] for i in runs}, seed)
        fitted = {i: simulated_targets(got[i]) for i in runs}
        for i in runs:
            for param, metric in (("per_token_s", "tpot_p50_s"), ("path_s", "idle_ttft_p50_s")):
                brackets[i][param][fitted[i][metric] > target[i][metric]] = mid[i][param]
    costs = {i: dataclasses.replace(base, per_token_s=mid[i]["per_token_s"]) for i in runs}
    return costs, {i: mid[i]["path_s"] for i in runs}, target, fitted


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
        per_seed = [sim_metrics(p[i]) for p in predicted]
        sim = {k: statistics.fmean(m[k] for m in per_seed) for k in per_seed[0]}
        summary = run["summary"]
        actual = {"hit_rate": summary["host_hit_rate"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
                  "ttft_p99_ms": summary["ttft_ms"]["p99"], "tpot_p50_ms": summary["tpot_ms"]["p50"]}
        rows.append({"run": i + 1, "setting": run["setting"], "routing": run["routing"], "real": actual,
                     "predicted": sim, "seed_range": {k: [min(m[k] for m in per_seed), max(m[k] for m in per_seed)]
                                                      for k in ("hit_rate", "ttft_p50_ms")},
                     "error": {k: relative_error(sim[k], actual[k]) for k in actual},
                     "real_idle_ttft_p50_ms": 1e3 * percentile(idle_arrivals(real_spans(records[i])), 50)})
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


def markdown(result: dict) -> str:
    lines = [f"### Fleet simulation against the real fleet ({result['real_path']})", "",
             f"`{result['command']}`; the real run: {result['real_started']}, {result['replicas']} replicas x "
             f"{result['num_adapters']} adapters, {result['duration_s']:g} s runs. Calibrated (per setting): "
             "per_token_s from the real TPOT p50, path_s from the real TTFT p50 of idle-replica arrivals; engine "
             f"steps from results/fleet_calibration.json; {result['cores']:g} cores shared. Predicted: mean of "
             f"{result['seeds']} seeds (range in brackets).", "",
             "| run | setting | routing | hit rate real / sim (range) | error | TTFT p50 ms real / sim (range) | error "
             "| TTFT p99 ms real / sim | TPOT p50 ms real / sim |", "|---" * 9 + "|"]
    for row in result["rows"]:
        real, sim, err, rng = row["real"], row["predicted"], row["error"], row["seed_range"]
        mark = {k: "" if abs(err[k]) <= BOUND else " ✗" for k in err}
        lines.append(
            f"| {row['run']} | {row['setting']} | {row['routing']} | {real['hit_rate']:.3f} / {sim['hit_rate']:.3f} "
            f"({rng['hit_rate'][0]:.3f}-{rng['hit_rate'][1]:.3f}) | {err['hit_rate']:+.1%}{mark['hit_rate']} | "
            f"{real['ttft_p50_ms']:.0f} / {sim['ttft_p50_ms']:.0f} ({rng['ttft_p50_ms'][0]:.0f}-"
            f"{rng['ttft_p50_ms'][1]:.0f}) | {err['ttft_p50_ms']:+.1%}{mark['ttft_p50_ms']} | "
            f"{real['ttft_p99_ms']:.0f} / {sim['ttft_p99_ms']:.0f} | {real['tpot_p50_ms']:.1f} / {sim['tpot_p50_ms']:.1f} |")
    lines += ["", "Calibration per run (real / simulated TPOT p50 and idle-arrival TTFT p50 in ms, the parameters): " +
              "; ".join(f"run {int(i) + 1}: {1e3 * t['tpot_p50_s']:.1f} / {1e3 * f['tpot_p50_s']:.1f}, "
                        f"{1e3 * t['idle_ttft_p50_s']:.0f} / {1e3 * f['idle_ttft_p50_s']:.0f}, per_token_s "
                        f"{1e3 * result['costs'][i]['per_token_s']:.2f} ms, path_s {1e3 * result['path_s'][i]:.1f} ms"
                        for i, t, f in ((i, result["calibration_targets"][i], result["calibration_fitted"][i])
                                        for i in result["costs"])) + ".", "", f"✗: off by more than {BOUND:.0%}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", type=Path, default=RESULTS / "fleet_validation_real.json")
    parser.add_argument("--records", type=Path, default=None, help="fleet.py's request records of that run")
    parser.add_argument("--cores", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="fleet_validation")
    args = parser.parse_args(argv)
    real = json.loads(args.real.read_text())
    records_path = args.records or find_records(real)
    records = {i: run["records"] for i, run in enumerate(json.loads(records_path.read_text()))}
    calibration = json.loads((RESULTS / "fleet_calibration.json").read_text())
    replay = Replay(real, args.cores, calibration["engine"]["max_num_batched_tokens"])
    costs, paths, targets, fitted = calibrate(replay, records, calibrated_costs(), seed=0)
    predicted = [replay.simulate(costs, paths, seed) for seed in range(args.seeds)]
    result = {"what": __doc__.split("\n\n")[0], "command": "python -m benchmarks.fleet_validate " + " ".join(
                  argv if argv is not None else __import__("sys").argv[1:]),
              "real_path": str(args.real.relative_to(RESULTS.parent.parent) if args.real.is_absolute()
                               and RESULTS.parent.parent in args.real.parents else args.real),
              "real_started": real["started"], "records": str(records_path), "replicas": replay.fleet.replicas,
              "num_adapters": replay.fleet.num_adapters, "duration_s": real["duration_s"], "cores": args.cores,
              "seeds": args.seeds, "engine_costs": dataclasses.asdict(calibrated_costs()),
              "costs": {str(i): dataclasses.asdict(c) for i, c in costs.items()}, "path_s": {str(i): p for i, p in paths.items()},
              "calibration_targets": {str(i): t for i, t in targets.items()},
              "calibration_fitted": {str(i): f for i, f in fitted.items()}, "rows": compare(real, records, predicted)}
    print(write_result(args.out, result))
    (RESULTS / f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
