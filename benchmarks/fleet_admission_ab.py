"""Why the 64 x 10,000 fleet simulation misses its TTFT p99 bound: the engine's admission taken apart, on one run.

    PYTHONHASHSEED=0 .venv/bin/python -m benchmarks.fleet_admission_ab [--cases steady-0.8:adapter-affinity,...]

The simulation (benchmarks/fleet_sim.py) admits as the engine does (benchmarks/fleet_admission.py: the engine's own
LoRABudget and admission order). Here the same phases and router run again with one part of that rule changed at
a time, so what each part costs the TTFT tail is read off side by side:
- "arrival order": waiting requests tried in arrival order, not those of running adapters first
  (workers/controller.py `_admission_order`);
- "no pauses": the budget never pauses a holder (LoRABudget with an unreachable `max_wait_steps`): a waiting
  adapter gets room only when one frees;
- both together: about the simulation before it drove LoRABudget (first come first served, skipping a request
  whose adapter has no room);
- "budget 64": the engine's rule with `max_loras_per_batch` 64 instead of NPU_SPEC's 32;
- "adapter 0.05 ms": the engine's rule with `per_adapter_s` 0.05 ms a distinct adapter a step instead of
  NPU_COSTS' (0.2 ms; 0.5 ms when results/fleet_sim_admission.md was recorded): the time to read a rank-16,
  seven-projection 8B adapter (88.6 MB) once from ~1.6 TB/s of device memory (benchmarks/fleet_costs.py runs
  the whole range).
The last two are what-ifs on the assumed replica, not changes to it.
Each against the same fleet serving one adapter at the same costs (the bound's baseline: budget and order
do not matter there).
Writes results/fleet_sim_admission.json and .md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

from benchmarks.fleet_admission import MAX_WAIT_STEPS, EngineQueues
from benchmarks.common import command, record
from benchmarks.fleet_sim import FLEET_SCENARIO, NPU_COSTS, PHASES, Simulation, requests_for
from benchmarks.fleet_sim_metrics import metrics

NEVER = 10 ** 9


class ArrivalOrder(EngineQueues):
    """The engine's LoRA budget, waiting requests tried in arrival order."""

    def _admission_order(self):
        return iter(list(self.waiting))


# name: (the engine's queues, max_wait_steps, replica spec changes, cost changes)
VARIANTS = {"engine": (EngineQueues, MAX_WAIT_STEPS, {}, {}), "arrival order": (ArrivalOrder, MAX_WAIT_STEPS, {}, {}),
            "no pauses": (EngineQueues, NEVER, {}, {}), "arrival order + no pauses": (ArrivalOrder, NEVER, {}, {}),
            "budget 64": (EngineQueues, MAX_WAIT_STEPS, {"max_loras_per_batch": 64}, {}),
            "adapter 0.05 ms": (EngineQueues, MAX_WAIT_STEPS, {}, {"per_adapter_s": 0.00005})}


def run(phase: str, router: str, variant: str, single_adapter: bool = False) -> dict:
    queues, max_wait_steps, spec, costs = VARIANTS[variant]
    scenario = dataclasses.replace(FLEET_SCENARIO, spec=dataclasses.replace(FLEET_SCENARIO.spec, **spec))
    requests = requests_for(scenario, PHASES[phase], 0, single_adapter)
    sim = Simulation(scenario, dataclasses.replace(NPU_COSTS, **costs), router)
    for replica in sim.replicas:
        replica.engine = queues(scenario.spec.max_num_seqs, scenario.spec.max_loras_per_batch, max_wait_steps)
    sim.run(requests)
    return metrics(sim, requests, PHASES[phase])


def summary(result: dict, single: dict) -> dict:
    waits, tail = result["waits"], result["waits"]["slowest_1pc"]
    return {"ttft_p99_s": result["ttft_p99_s"], "ttft_p99_over_single": result["ttft_p99_s"] / single["ttft_p99_s"],
            "ttft_p50_s": result["ttft_p50_s"], "tpot_p50_s": result["tpot_p50_s"],
            "output_tok_s": result["output_tok_s"], "hit_rate": result["hit_rate"],
            "distinct_adapters_per_step": result["distinct_adapters_per_step"],
            "lora_pauses_per_step": waits["lora_pauses_per_step"], "running_per_step": waits["running_per_step"],
            "paused_per_step": waits["paused_per_step"], "tail_engine_queue_steps": tail["engine_queue_steps"],
            "tail_lora_budget_steps": tail["lora_budget_steps"],
            "tail_share_found_engine_full": tail["share_found_engine_full"], "lost": result["lost"]}


COLS = (("ttft_p99_s", "TTFT p99 s", ".2f"), ("ttft_p99_over_single", "over single", ".2f"),
        ("ttft_p50_s", "TTFT p50 s", ".3f"), ("tpot_p50_s", "TPOT p50 s", ".3f"), ("output_tok_s", "out tok/s", ".0f"),
        ("distinct_adapters_per_step", "adapters / step", ".1f"), ("lora_pauses_per_step", "pauses / step", ".3f"),
        ("running_per_step", "running / step", ".1f"), ("paused_per_step", "paused / step", ".2f"),
        ("tail_engine_queue_steps", "slowest 1 %: queue steps", ".0f"),
        ("tail_lora_budget_steps", "of them on the budget", ".0f"),
        ("tail_share_found_engine_full", "found the engine full", ".2f"), ("lost", "lost", "d"))


def markdown(result: dict) -> str:
    lines = ["### The fleet simulation's TTFT tail, the engine's admission taken apart", "",
             f"`{result['command']}` ({result['cpu_s']:.0f} s of CPU); benchmarks/fleet_admission_ab.py says what "
             "each variant changes; 'single' = the same fleet serving one adapter; slowest 1 % = TTFT at or above "
             "the p99; 'found the engine full': its `max_num_seqs` places were taken when it queued.", "",
             "| case | variant | " + " | ".join(name for _, name, _ in COLS) + " |", "|---" * (len(COLS) + 2) + "|"]
    for case, got in result["cases"].items():
        singles = ", ".join(f"{s:.2f} s" + (f" ({costs})" if costs != "{}" else "")
                            for costs, s in got["single_ttft_p99_s"].items())
        lines.append(f"| {case} | single adapter: TTFT p99 {singles} |" + " |" * len(COLS))
        for variant, row in got["variants"].items():
            lines.append(f"| {case} | {variant} | " + " | ".join(format(row[k], f) for k, _, f in COLS) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="steady-0.8:adapter-affinity,drift:adapter-affinity,"
                                           "steady-1.2:serve-default", help="phase:router, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    started = time.process_time()
    result = {"what": __doc__.split("\n\n")[0], "cases": {},
              "command": command("benchmarks.fleet_admission_ab", argv)}
    for case in args.cases.split(","):
        phase, router = case.split(":")
        singles = {}   # one adapter: budget and order do not matter, its step cost does
        got = result["cases"][case] = {"single_ttft_p99_s": {}, "variants": {}}
        for variant in args.variants.split(","):
            costs = json.dumps(VARIANTS[variant][3])
            if costs not in singles:
                singles[costs] = run(phase, router, variant, single_adapter=True)
                got["single_ttft_p99_s"][costs] = singles[costs]["ttft_p99_s"]
            got["variants"][variant] = summary(run(phase, router, variant), singles[costs])
            print(case, variant, json.dumps({k: round(v, 3) for k, v in got["variants"][variant].items()}),
                  flush=True)
    return record("fleet_sim_admission", result, started, markdown)

if __name__ == "__main__":
    main()
