"""Our router's knobs in the fleet simulation, at both sizes: the real fleet's (its recorded arrivals replayed, as
benchmarks/fleet_validate.py does) and 64 replicas x 10,000 adapters (benchmarks/fleet_sim.py).

    .venv/bin/python -m benchmarks.fleet_knobs [--options '[{}, {"cold_spill_factor": 3.0}]'] [--fleet '{"rate": 20}']

For each set of AffinityPolicy knobs (and prefetch_fill), per setting: host-cache hit rate, imbalance p99 (max /
mean in-flight over 10 s windows), TTFT p99, and at 64 x 10,000 the issue's bounds (cold loads per replica per
second, TTFT p99 over the same fleet serving one adapter); Serve's default router beside them. A search aid, not
the acceptance's evidence: the real fleet's numbers are benchmarks/fleet.py's. The replay keeps the cores as
processor sharing with a constant `--background` of other jobs (fleet_validate fits one per run instead) and no
path latency, so its TTFTs compare knobs with each other, not with the real runs. Writes results/<--out>.json / .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from benchmarks.common import RESULTS, write_result
from benchmarks.fleet_calibration import calibrated_costs
from benchmarks.fleet_sim import FLEET_SCENARIO, NPU_COSTS, PHASES, simulate
from benchmarks.fleet_sim_metrics import percentile, window_ratios
from benchmarks.fleet_validate import ROUTERS, Replay, serving_costs, sim_metrics

DRAIN_S = 5.0   # output tok/s: the tokens of the requests that finished by this long after the last arrival
VARIANTS = [{}, {"cold_spill_factor": 3.0, "home_share": 0.25},
            {"cold_spill_factor": 2.0, "home_share": 0.25, "load_factor": 1.0, "min_spill_load": 1}]


def real_size(options: dict, replay: Replay, costs, background: float, seeds: int) -> dict:
    """Setting -> routing -> mean over seeds of hit rate, imbalance p99, TTFT p99 (ms), each setting's first run."""
    first = {}
    for i, setting, routing in replay.runs:
        first.setdefault((setting, routing), i)
    per_seed = []
    for seed in range(seeds):
        windows: dict = {}
        got = replay.simulate(costs, {i: background for i, _, _ in replay.runs}, seed, tuple(options.items()), windows)
        row = {}
        for (setting, routing), i in first.items():
            sim, start, end = windows[i]
            metrics = sim_metrics(got[i], replay.fleet.replicas)
            tokens = sum(r.output_tokens for r in got[i] if r.finished_at is not None and r.finished_at <= end + DRAIN_S)
            row[(setting, routing)] = {"hit_rate": metrics["hit_rate"], "ttft_p99_ms": metrics["ttft_p99_ms"],
                                       "imbalance_p99": percentile(window_ratios(sim.samples, start, end), 99),
                                       "output_tok_s": tokens / (end - start)}
        per_seed.append(row)
    return {f"{setting} {routing}": {k: statistics.fmean(r[(setting, routing)][k] for r in per_seed)
                                     for k in per_seed[0][(setting, routing)]} for setting, routing in first}


def fleet_size(options: dict, phases: list[str]) -> dict:
    out = {}
    for name in phases:
        result = simulate(FLEET_SCENARIO, NPU_COSTS, "adapter-affinity", PHASES[name], options=tuple(options.items()))
        single = simulate(FLEET_SCENARIO, NPU_COSTS, "adapter-affinity", PHASES[name], single_adapter=True,
                          options=tuple(options.items()))
        out[name] = {"hit_rate": result["hit_rate"], "imbalance_p99": result["imbalance_p99"],
                     "cold_loads_per_replica_s": result["cold_loads_per_replica_s"],
                     "ttft_p99_over_single": result["ttft_p99_s"] / single["ttft_p99_s"]}
    return out


def markdown(result: dict) -> str:
    variants = result["variants"]
    names = [json.dumps(v["options"]) for v in variants]
    settings = dict.fromkeys(key.split()[0] for key in variants[0]["real"])
    lines = [f"`{result['command']}`", "", f"Real size: {result['real']} replayed ({result['fleet']}), background "
             f"{result['background']:g} jobs, {result['seeds']} seeds. Cells: hit rate / imbalance p99 / TTFT p99 ms / "
             "output tok/s; "
             "ours with each set of knobs ({} = the defaults), Serve's default router first.", "",
             "| setting | Serve's default | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]

    def cell(c: dict) -> str:
        return f"{c['hit_rate']:.3f} / {c['imbalance_p99']:.2f} / {c['ttft_p99_ms']:.0f} / {c['output_tok_s']:.0f}"
    for setting in settings:
        lines.append(f"| {setting} | {cell(variants[0]['real'][f'{setting} multiplex'])} | " + " | ".join(
            cell(v["real"][f"{setting} adapter-affinity"]) for v in variants) + " |")
    if result["phases"]:
        lines += ["", "64 replicas x 10,000 adapters (fleet_sim's NPU costs), ours. Cells: hit rate / imbalance p99 / "
                  "cold loads per replica-s / TTFT p99 over the same fleet serving one adapter.", "",
                  "| phase | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for phase in result["phases"]:
            lines.append(f"| {phase} | " + " | ".join(
                f"{c['hit_rate']:.3f} / {c['imbalance_p99']:.2f} / {c['cold_loads_per_replica_s']:.3f} / "
                f"{c['ttft_p99_over_single']:.2f}" for c in (v["fleet"][phase] for v in variants)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", type=json.loads, default=VARIANTS, help="a JSON list of knob sets")
    parser.add_argument("--real", default=str(RESULTS / "fleet.json"), help="a recorded benchmarks/fleet.py run")
    parser.add_argument("--fleet", type=json.loads, default={},
                        help='FleetSpec fields over the run\'s, e.g. {"max_loaded_loras": 64, "rate": 20}')
    parser.add_argument("--background", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--phases", default=",".join(PHASES), help="64 x 10,000 phases ('' for none)")
    parser.add_argument("--out", default="fleet_knobs")
    args = parser.parse_args(argv)
    real = json.loads(open(args.real).read())
    calibration = json.loads((RESULTS / "fleet_calibration.json").read_text())
    costs, path_cpu_s = serving_costs(calibrated_costs(), json.loads((RESULTS / "fleet_path_cpu.json").read_text()))
    real["fleet"].update(args.fleet)   # the replayed arrivals follow its rate
    replay = Replay(real, 2.0, calibration["engine"]["max_num_batched_tokens"], path_cpu_s, 0.0)
    phases = [p for p in args.phases.split(",") if p]
    command = "python -m benchmarks.fleet_knobs " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command, "real": args.real,
              "fleet": dataclasses.asdict(replay.fleet), "background": args.background, "seeds": args.seeds,
              "phases": phases, "routers": list(ROUTERS.values()), "variants": []}
    for options in args.options:
        result["variants"].append({"options": options,
                                   "real": real_size(options, replay, costs, args.background, args.seeds),
                                   "fleet": fleet_size(options, phases)})
        print(json.dumps(result["variants"][-1]), flush=True)
    write_result(args.out, result)
    (RESULTS / f"{args.out}.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
