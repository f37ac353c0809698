"""benchmarks/results/fleet.md from fleet.json: a table per setting, ours against Serve's default in run pairs
(the issue's acceptance at Zipf 1.0), and the replica kill."""
from __future__ import annotations

import statistics

DEFAULT, OURS = "multiplex", "adapter-affinity"
COLUMNS = ("run", "routing", "hit rate", "cold loads / replica / min", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
           "out tok/s", "imbalance p99 (p50)", "adapters / step", "errors", "lost", "replicas used",
           "served by hash-first replica", "adapters on > 1 replica")


def row(i: int, run: dict) -> list[str]:
    s = run["summary"]
    return [str(i), run["routing"], _f(s["host_hit_rate"], 3), _f(s["cold_loads_per_replica_min"], 1),
            _f(s["ttft_ms"]["p50"], 0), _f(s["ttft_ms"]["p99"], 0), _f(s["tpot_ms"]["p50"], 1),
            _f(s["output_tok_s"], 1), f"{_f(s['imbalance']['p99'], 2)} ({_f(s['imbalance']['p50'], 2)})",
            _f(s["adapters_per_step"], 2), str(s["errors"]), str(s["lost"]), str(s["replicas_used"]),
            _f(s["placement"]["served_at_hash_rank"][0], 2),
            f"{s['placement']['adapters_on_several_replicas']} of {s['placement']['adapters']}"]


def pairs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """(default, ours) of each consecutive pair of runs of a setting (a, b, b, a: two pairs)."""
    plain = [r for r in runs if r["routing"] in (DEFAULT, OURS)]
    out = []
    for a, b in zip(plain[::2], plain[1::2]):
        by = {a["routing"]: a, b["routing"]: b}
        if set(by) == {DEFAULT, OURS}:
            out.append((by[DEFAULT], by[OURS]))
    return out


def acceptance(runs: list[dict]) -> list[str]:
    got = pairs(runs)
    if not got:
        return []
    ours = [o["summary"] for _, o in got]
    ttft = [o["summary"]["ttft_ms"]["p99"] / d["summary"]["ttft_ms"]["p99"] for d, o in got]
    tok = [o["summary"]["output_tok_s"] / d["summary"]["output_tok_s"] for d, o in got]
    checks = [("host-cache hit rate (ours)", [s["host_hit_rate"] for s in ours], ">= 0.95", lambda v: v >= 0.95),
              ("TTFT p99 ours / default", ttft, "<= 0.5", lambda v: v <= 0.5),
              ("output tok/s ours / default", tok, ">= 1.2", lambda v: v >= 1.2),
              ("imbalance p99 (ours)", [s["imbalance"]["p99"] for s in ours], "<= 1.3", lambda v: v <= 1.3),
              ("requests lost (ours)", [s["lost"] for s in ours], "0", lambda v: v == 0)]
    lines = ["| acceptance (Zipf 1.0) | per pair | median | target | |", "|---|---|---|---|---|"]
    for name, values, target, ok in checks:
        median = statistics.median(values)
        lines.append(f"| {name} | {', '.join(_f(v, 3) for v in values)} | {_f(median, 3)} | {target} | "
                     f"{'met' if ok(median) else '**missed**'} |")
    return lines


def markdown(result: dict) -> str:
    fleet = result["fleet"]
    lines = [f"# Fleet: {fleet['replicas']} replicas, {fleet['num_adapters']} adapters "
             f"({'quick' if result['quick'] else 'full'} run, {result['started']}, {result['wall_s'] / 60:.1f} min)",
             "", f"Arrivals and lengths: {result['trace']}, conversation trace, {fleet['rate']} req/s, "
             f"{result['duration_s']:.0f} s per run. FleetSpec: {fleet}. Run order: {', '.join(result['order'])}.", ""]
    if result.get("replica_cpus"):
        lines += [f"Each replica (its actor and engine processes) capped at {result['replica_cpus']:g} cores by a CPU "
                  "quota (benchmarks/replica_cpu.py), as a replica with cores of its own; the ingress, proxy and "
                  "client outside the quotas.", ""]
    settings = list(dict.fromkeys(r["setting"] for r in result["runs"]))
    for setting in settings:
        runs = [r for r in result["runs"] if r["setting"] == setting]
        lines += [f"## {setting}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(row(i, r)) + " |" for i, r in enumerate(runs, 1)]
        lines.append("")
        if setting == "zipf-1.0":
            lines += acceptance(runs) + [""]
        for r in runs:
            if "kill" in r:
                k = r["kill"]
                lines += [f"Replica kill ({r['routing']}): {k.get('replica')} killed at {_f(k.get('at'), 1)} s. "
                          f"Hit rate over 5 s windows: {_f(k['before_mean'], 3)} before (mean), lowest after "
                          f"{_f(k['lowest_after'], 3)}, back at or above 0.9 {_f(k['back_after_s'], 1)} s after "
                          f"the kill (target <= 30 s), {_f(k['windows_at_or_above_since'], 2)} of the windows from "
                          f"then on at or above it; errors {r['summary']['errors']}, lost {r['summary']['lost']}.",
                          ""]
    return "\n".join(lines) + "\n"


def _f(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
