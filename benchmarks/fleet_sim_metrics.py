"""What a fleet simulation run measured (benchmarks/fleet_sim.py's Simulation, also driven by fleet_validate.py and
fleet_admission_ab.py): hit rate, cold loads, TTFT / TPOT percentiles, output tokens, imbalance over sliding windows
of the replicas' in-flight samples, the hot spot's ramp, and where the slowest first tokens waited (fleet_waits.py).
Apart from the simulation itself: these read a finished run and its samples, they do not drive it."""
from __future__ import annotations

import math

from benchmarks.fleet_replica import SimRequest
from benchmarks.fleet_waits import ttft_waits
from benchmarks.fleet_workload import Phase

TICK_S = 0.1           # load samples and Serve's replica-set broadcasts
WINDOW_S = 10.0        # imbalance: max / mean of the replicas' mean in-flight over 10 s windows (1 s apart)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def window_ratios(samples: list[list[int]], start: float, end: float) -> list[float]:
    """max / mean of the replicas' mean in-flight, per WINDOW_S window starting every second in [start, end)."""
    per_window = round(WINDOW_S / TICK_S)
    out = []
    first, last = round(start / TICK_S), min(len(samples), round(end / TICK_S))
    for begin in range(first, last - per_window + 1, round(1 / TICK_S)):
        window = samples[begin:begin + per_window]
        means = [sum(col) / len(window) for col in zip(*window)]
        mean = sum(means) / len(means)
        if mean > 0:
            out.append(max(means) / mean)
    return out


def metrics(sim, requests: list[SimRequest], phase: Phase) -> dict:
    """The measured window of a finished run (`sim`: a fleet_sim.Simulation, not imported: it imports this)."""
    sc = sim.scenario
    start, end = sc.warmup_s, sc.warmup_s + sc.duration_s
    measured = [r for r in requests if start <= r.at < end]
    done = [r for r in measured if r.finished_at >= 0]
    ttft = [r.first_token_at - r.at for r in done]
    tpot = [(r.finished_at - r.first_token_at) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    tokens = sum(r.output_tokens for r in requests if start <= r.finished_at < end)
    steps = sum(r.steps for r in sim.replicas)
    out = {"requests": len(measured), "lost": len(measured) - len(done),
           "hit_rate": sum(r.hit for r in measured) / max(1, len(measured)),
           "cold_loads_per_replica_s": sum(start <= t < end for t in sim.cold_loads) / sc.replicas / sc.duration_s,
           "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99), "tpot_p50_s": percentile(tpot, 50),
           "output_tok_s": tokens / sc.duration_s, "imbalance_p99": percentile(window_ratios(sim.samples, start, end), 99),
           "distinct_adapters_per_step": sum(r.adapters_per_step for r in sim.replicas) / max(1, steps)}
    out["waits"] = ttft_waits(done, out["ttft_p99_s"], sim.replicas)
    if phase.name == "hotspot":
        at = start + phase.hotspot_at_s
        ramp = window_ratios(sim.samples, at - WINDOW_S / 2, at + phase.hotspot_ramp_s + WINDOW_S)
        out["hotspot_max_over_mean"] = max(ramp) if ramp else float("nan")
    return out
