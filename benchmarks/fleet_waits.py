"""Where first tokens wait in the fleet simulation (benchmarks/fleet_sim.py): the TTFT of a request taken apart.

From a request's arrival to its first token: routing and the serving path (Serve's backoff when no replica has
room, then the path) until it reaches its replica; the cold load of its adapter there (Serve's multiplexed loader,
one load at a time); the engine's waiting queue until admission (steps skipped for lack of room in the LoRA budget,
or stopped by `max_num_seqs` / the token budget); its prompt's steps until the first token (chunks, and steps its
adapter sat paused). Reported for every measured request and for the slowest 1 % (TTFT at or above the p99).
"""
from __future__ import annotations

import statistics


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")


def breakdown(requests: list) -> dict:
    """Mean seconds of each part of the TTFT, and what the engine's queue waited on."""
    return {"count": len(requests),
            "ttft_s": _mean(r.first_token_at - r.at for r in requests),
            "to_replica_s": _mean(r.reached_at - r.at for r in requests),
            "cold_load_s": _mean(r.queued_at - r.reached_at for r in requests),
            "engine_queue_s": _mean(r.admitted_at - r.queued_at for r in requests),
            "prompt_steps_s": _mean(r.first_token_at - r.admitted_at for r in requests),
            "engine_queue_steps": _mean(r.admitted_step - r.queued_step for r in requests),
            "lora_budget_steps": _mean(r.budget_skips for r in requests),
            "share_waited_on_budget": _mean(r.budget_skips > 0 for r in requests),
            "share_found_engine_full": _mean(r.full_at_queue for r in requests),
            "share_cold": _mean(not r.hit for r in requests),
            "arrival_s_min_median_max": ([min(r.at for r in requests), statistics.median(r.at for r in requests),
                                          max(r.at for r in requests)] if requests else [])}


def ttft_waits(done: list, p99_s: float, replicas: list) -> dict:
    """`breakdown` of every finished measured request and of those at or above the TTFT p99; the LoRA budget's
    pauses (holders sat out for an older waiter) per engine step over the whole run, and the running requests per
    step and of them those paused (they keep their place: `max_num_seqs` counts them)."""
    tail = [r for r in done if r.first_token_at - r.at >= p99_s]
    steps = sum(r.steps for r in replicas)
    engines = [r.engine for r in replicas]
    return {"all": breakdown(done), "slowest_1pc": breakdown(tail),
            "lora_pauses_per_step": sum(e.budget.num_pauses for e in engines) / max(1, steps),
            "running_per_step": sum(e.running_steps for e in engines) / max(1, steps),
            "paused_per_step": sum(e.paused_steps for e in engines) / max(1, steps)}


def markdown(rows: dict) -> list[str]:
    """Lines of a table: each row's TTFT parts, its slowest 1 % beside the same fleet serving one adapter."""
    lines = ["", "Where the first tokens wait (benchmarks/fleet_waits.py; mean seconds, slowest 1 % = TTFT at or above "
             "the p99; 'single' = the same router and trace serving one adapter): routing and path / cold load / "
             "engine queue / prompt steps; queue steps and of them steps skipped on the LoRA budget; shares that "
             "waited on the budget, found the engine's `max_num_seqs` places taken, were cold.", "",
             "| phase / router | requests | TTFT | parts | queue steps (budget) | on budget / engine full / cold "
             "| per step: LoRA pauses, running (paused) |", "|---" * 7 + "|"]
    for key, row in rows.items():
        for label, waits in (("all", row["waits"]["all"]), ("slowest 1 %", row["waits"]["slowest_1pc"]),
                             ("single, slowest 1 %", row["single_adapter_waits"]["slowest_1pc"])):
            w = row["waits"]
            pauses = (f"{w['lora_pauses_per_step']:.3f}, {w.get('running_per_step', float('nan')):.1f} "
                      f"({w.get('paused_per_step', float('nan')):.1f})") if label == "all" else ""
            lines.append(
                f"| {key}, {label} | {waits['count']} | {waits['ttft_s']:.2f} | {waits['to_replica_s']:.2f} / "
                f"{waits['cold_load_s']:.2f} / {waits['engine_queue_s']:.2f} / {waits['prompt_steps_s']:.2f} | "
                f"{waits['engine_queue_steps']:.0f} ({waits['lora_budget_steps']:.0f}) | "
                f"{waits['share_waited_on_budget']:.2f} / {waits['share_found_engine_full']:.2f} / "
                f"{waits['share_cold']:.2f} | {pauses} |")
    return lines
