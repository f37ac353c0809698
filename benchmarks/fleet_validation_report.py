"""The table of benchmarks/fleet_validate.py's result: the fleet simulation's predictions against each recorded real
run, per background fit, with how many runs fall within BOUND. Apart from the validation: it only renders its
result."""
from __future__ import annotations

BOUND = 0.15   # a prediction off by more than this is marked
FIT_NAMES = {"tpot": "TPOT p50 (the engine side)", "idle-ttft": "TTFT p50 of idle-replica arrivals (the path side)"}


def markdown(result: dict) -> str:
    lines = [f"### Fleet simulation against the real fleet ({result['real_path']})", "",
             f"The real run: {result['real_started']}, {result['replicas']} replicas x "
             f"{result['num_adapters']} adapters, {result['duration_s']:g} s runs. Engine steps from "
             "results/fleet_calibration.json; serving work measured by results/fleet_path_cpu.json (per request "
             f"{1e3 * result['path_cpu_s']:.1f} ms of CPU before the engine, per token "
             f"{1e3 * result['costs']['per_token_s']:.2f} ms beside the step); " + (
                 f"each replica's steps on a quota of {result['replica_cores']:g} cores (processor sharing), the "
                 f"paths on the {result['cores']:g} cores left" if result.get("replica_cores") else
                 f"steps and paths share {result['cores']:g} cores") +
             " with `background` jobs, fitted per run (two ways: below); a lone request's "
             f"path {1e3 * result['path_floor_s']:.1f} ms (the runs' first requests), "
             f"{result['path_before_routing']:.0%} of its work before the router chooses. Predicted: mean of "
             f"{result['seeds']} seeds (range in brackets). ✗: off by more than {BOUND:.0%}."]
    for fit, got in result["fits"].items():
        lines += ["", f"Background fitted to each run's {FIT_NAMES[fit]}:", "",
                  "| run | setting | routing | hit rate real / sim (range) | error | TTFT p50 ms real / sim (range) "
                  "| error | TTFT p99 ms real / sim | idle-arrival TTFT p50 ms real / sim | TPOT p50 ms real / sim "
                  "| background | on the hash-first replica real / sim |", "|---" * 12 + "|"]
        for row in got["rows"]:
            real, sim, err, rng = row["real"], row["predicted"], row["error"], row["seed_range"]
            mark = {k: "" if abs(err[k]) <= BOUND else " ✗" for k in err}
            lines.append(
                f"| {row['run']} | {row['setting']} | {row['routing']} | {real['hit_rate']:.3f} / "
                f"{sim['hit_rate']:.3f} ({rng['hit_rate'][0]:.3f}-{rng['hit_rate'][1]:.3f}) | "
                f"{err['hit_rate']:+.1%}{mark['hit_rate']} | {real['ttft_p50_ms']:.0f} / {sim['ttft_p50_ms']:.0f} "
                f"({rng['ttft_p50_ms'][0]:.0f}-{rng['ttft_p50_ms'][1]:.0f}) | "
                f"{err['ttft_p50_ms']:+.1%}{mark['ttft_p50_ms']} | {real['ttft_p99_ms']:.0f} / "
                f"{sim['ttft_p99_ms']:.0f} | {real['idle_ttft_p50_ms']:.0f} / {sim['idle_ttft_p50_ms']:.0f} | "
                f"{real['tpot_p50_ms']:.1f} / {sim['tpot_p50_ms']:.1f} | "
                f"{got['background_jobs'][str(row['run'] - 1)]:.2f} | {real['home_share']:.2f} / "
                f"{sim['home_share']:.2f} |")
        within = {k: sum(abs(row["error"][k]) <= BOUND for row in got["rows"]) for k in ("hit_rate", "ttft_p50_ms")}
        lines += ["", f"Within {BOUND:.0%}: hit rate {within['hit_rate']} of {len(got['rows'])} runs, TTFT p50 "
                  f"{within['ttft_p50_ms']} of {len(got['rows'])}."]
    return "\n".join(lines) + "\n"
