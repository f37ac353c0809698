"""How the 64 x 10,000 fleet simulation's TTFT bound depends on the one replica cost it cannot measure here: what a
decode step pays per distinct adapter in it.

    PYTHONHASHSEED=0 .venv/bin/python -m benchmarks.fleet_costs [--per-adapter-ms 0.05,0.1,0.2,0.3,0.4,0.5]
        [--phases steady-0.8] [--jobs 2]

benchmarks/fleet_sim.py models a replica's decode step as base + per sequence + per distinct adapter (NPU_COSTS).
The last term is the LoRA kernel's: on Ascend our backend runs one shrink and one expand launch per projection and
layer for every adapter of the step together (lora/backends/ascend.py, bgmv in decode), so a distinct adapter costs
the reading of its weights, not launches of its own. Here every other cost stays NPU_COSTS' and that one term takes
each value given, for both routers, each against the same fleet serving one adapter at the same costs (the bound's
baseline). Writes results/fleet_costs.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.common import command, record
from benchmarks.fleet_sim import ACCEPT, NPU_COSTS, ROUTERS, phase_row

BOUND = dict((metric, bound) for metric, _, bound in ACCEPT)["ttft_p99_over_single"]


def one(case: tuple[float, str, str]) -> dict:
    per_adapter_ms, phase, router = case
    result = phase_row((dataclasses.replace(NPU_COSTS, per_adapter_s=per_adapter_ms / 1e3), phase, router, 0))
    return {"per_adapter_ms": per_adapter_ms, "phase": phase, "router": router,
            **{k: result[k] for k in ("hit_rate", "cold_loads_per_replica_s", "imbalance_p99", "ttft_p99_s",
                                      "single_adapter_ttft_p99_s", "ttft_p99_over_single",
                                      "distinct_adapters_per_step", "lost")}}


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "", "NPU_COSTS (benchmarks/fleet_sim.py) with its per-distinct-adapter step "
             "cost replaced; cells: hit rate / TTFT p99 s (single-adapter fleet's) / TTFT p99 over single "
             f"(bound {BOUND:g}) / distinct adapters a step.", "",
             "| per adapter ms | phase | " + " | ".join(ROUTERS) + " |", "|---" * (len(ROUTERS) + 2) + "|"]
    rows = {(r["per_adapter_ms"], r["phase"], r["router"]): r for r in result["runs"]}
    for ms, phase in dict.fromkeys((r["per_adapter_ms"], r["phase"]) for r in result["runs"]):
        cells = []
        for router in ROUTERS:
            r = rows[(ms, phase, router)]
            mark = "" if r["ttft_p99_over_single"] <= BOUND else " ✗"
            cells.append(f"{r['hit_rate']:.3f} / {r['ttft_p99_s']:.2f} ({r['single_adapter_ttft_p99_s']:.2f}) / "
                         f"{r['ttft_p99_over_single']:.2f}{mark} / {r['distinct_adapters_per_step']:.1f}")
        lines.append(f"| {ms:g} | {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-adapter-ms", default="0.05,0.1,0.2,0.3,0.4,0.5")
    parser.add_argument("--phases", default="steady-0.8")
    parser.add_argument("--jobs", type=int, default=1, help="simulations run side by side (one core each)")
    args = parser.parse_args(argv)
    started = time.process_time()
    cases = [(float(ms), phase, router) for ms in args.per_adapter_ms.split(",") for phase in args.phases.split(",")
             for router in ROUTERS]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(one, cases))
    for run in runs:
        print(run, flush=True)
    result = {"what": __doc__.split("\n\n")[0], "npu_costs": dataclasses.asdict(NPU_COSTS), "runs": runs,
              "command": command("benchmarks.fleet_costs", argv)}
    return record("fleet_costs", result, started, markdown)


if __name__ == "__main__":
    main()
