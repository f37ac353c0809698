"""Tensor parallelism's per-step cost: steps through shared memory vs a Ray call per rank (issue 40 item 4).

    .venv/bin/python -m benchmarks.tp_dispatch        (about two minutes on 2 CPU cores)

Three engines side by side on one tiny random Qwen3 checkpoint (the tests' factory), CPU, one
torch thread per process: TP 1 in-process, TP 2 driven through shared memory with shared-memory
collectives (the default), and TP 2 as before (LORASERVE_TP_DISPATCH=ray: a Ray call per rank per
step, gloo's collectives over loopback). Rounds alternate the engines, so load from other
processes hits each alike. Measured:
- dispatch: an empty round trip to every rank and back (a no-op method on each rank: through
  the queues, or as one Ray call per rank), median and p99;
- per token: a decode step of one request, median, TP 2 over TP 1;
- after idle: the round trip and a decode step after 30 s without a step (the ranks' loops have
  backed off to their longest sleep);
- idle CPU: each rank's CPU seconds (/proc) over 10 s without a step, as % of a core.
Written to benchmarks/results/tp_dispatch.json and .md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the tiny-checkpoint factory shared with the tests

from benchmarks.actor_hop import decode_step_seconds, tiny_engines   # noqa: E402
from benchmarks.common import machine_info, write_result   # noqa: E402
from benchmarks.procfs import process_cpu_seconds   # noqa: E402

MODES = {"tp1": dict(), "tp2_shm": dict(tensor_parallel_size=2), "tp2_ray": dict(tensor_parallel_size=2)}
TP2 = ("tp2_shm", "tp2_ray")


def round_trip_seconds(executor, shm: bool) -> float:
    start = time.perf_counter()
    if shm:
        executor._call("is_alive")   # noqa: SLF001  (the step path itself, with a no-op for a step)
    else:
        executor._gather([w.is_alive.remote() for w in executor.workers], 60, "ping")   # noqa: SLF001
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def idle_measures(engines: dict, idle_s: float, cpu_window_s: float) -> dict:
    """Every TP 2 engine idle at once for `idle_s`: its ranks' CPU over the last `cpu_window_s`, then the first
    round trip, then (a request already admitted) the first decode step."""
    import ray

    from workers import SamplingParams

    pids = {mode: [p["pid"] for p in ray.get([w.placement.remote() for w in engines[mode].executor.workers])]
            for mode in TP2}
    for mode in TP2:
        engines[mode].add_request("Hello there", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engines[mode].step()   # the prefill: the next step is a decode
    time.sleep(idle_s - cpu_window_s)
    cpu0 = {mode: [process_cpu_seconds(p) for p in pids[mode]] for mode in TP2}
    time.sleep(cpu_window_s)
    cpu1 = {mode: [process_cpu_seconds(p) for p in pids[mode]] for mode in TP2}
    out = {}
    for mode in TP2:
        trip = round_trip_seconds(engines[mode].executor, mode == "tp2_shm")
        out[mode] = {"idle_rank_cpu_percent": [round(100 * (b - a) / cpu_window_s, 2)
                                              for a, b in zip(cpu0[mode], cpu1[mode])],
                     "first_round_trip_after_idle_ms": round(1e3 * trip, 3)}
    time.sleep(idle_s)   # idle again before the decode step
    for mode in TP2:
        start = time.perf_counter()
        engines[mode].step()
        out[mode]["first_decode_step_after_idle_ms"] = round(1e3 * (time.perf_counter() - start), 3)
        while engines[mode].has_unfinished():
            engines[mode].step()
    return out


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--trips", type=int, default=400, help="empty round trips per engine per round")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per engine per round")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds without a step before the after-idle step")
    args = parser.parse_args()

    from factories import PROMPTS
    from workers.worker_group import TP_DISPATCH_ENV

    def dispatch(mode: str) -> None:   # read when the group starts
        os.environ[TP_DISPATCH_ENV] = "ray" if mode == "tp2_ray" else "shm"

    try:
        with tiny_engines(MODES, "lstpd", num_cpus=4, before_each=dispatch) as engines:
            os.environ.pop(TP_DISPATCH_ENV)
            assert engines["tp2_shm"].executor._steps is not None and engines["tp2_ray"].executor._steps is None  # noqa
            for engine in engines.values():   # warm-up, not recorded
                decode_step_seconds(engine, PROMPTS[:1], 4)
            trips = {mode: [] for mode in TP2}
            steps = {mode: [] for mode in engines}
            for _ in range(args.rounds):
                for mode in TP2:
                    trips[mode] += [round_trip_seconds(engines[mode].executor, mode == "tp2_shm")
                                    for _ in range(args.trips)]
                for mode, engine in engines.items():
                    steps[mode] += decode_step_seconds(engine, PROMPTS[:1], args.steps)
            idle = idle_measures(engines, args.idle, min(10.0, args.idle / 2))
    finally:
        os.environ.pop(TP_DISPATCH_ENV, None)

    step_ms = {mode: 1e3 * statistics.median(s) for mode, s in steps.items()}
    result = {
        "benchmark": "tp_dispatch", "model": "tiny random qwen3 (tests/factories.py make_model)", "device": "cpu",
        "batch": 1, "rounds": args.rounds,
        "dispatch_round_trip_ms": {mode: {"median": round(1e3 * statistics.median(t), 4),
                                          "p99": round(1e3 * percentile(t, 0.99), 4), "n": len(t)}
                                   for mode, t in trips.items()},
        "decode_step_ms_median": {mode: round(ms, 3) for mode, ms in step_ms.items()},
        "tp2_over_tp1": {mode: round(step_ms[mode] / step_ms["tp1"], 2) for mode in TP2},
        "idle_s": args.idle, "after_idle": idle,
        "host": machine_info(), "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    write_result("tp_dispatch", result)
    (ROOT / "benchmarks" / "results" / "tp_dispatch.md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    rows = ["# TP 2 dispatch: shared memory vs a Ray call per rank", "",
            "`.venv/bin/python -m benchmarks.tp_dispatch` (" + r["recorded"] + f", {r['rounds']} alternating rounds, "
            "tiny Qwen3, CPU, one torch thread per process)", "",
            "| | TP 2 shm (new) | TP 2 Ray + gloo (before) | target |", "|---|---|---|---|"]
    trip, idle = r["dispatch_round_trip_ms"], r["after_idle"]
    rows += [f"| empty round trip median (ms) | {trip['tp2_shm']['median']} | {trip['tp2_ray']['median']} | <= 0.2 |",
             f"| empty round trip p99 (ms) | {trip['tp2_shm']['p99']} | {trip['tp2_ray']['p99']} | <= 1 |",
             f"| decode step, batch 1 (ms; TP 1: {r['decode_step_ms_median']['tp1']}) | "
             f"{r['decode_step_ms_median']['tp2_shm']} | {r['decode_step_ms_median']['tp2_ray']} | |",
             f"| TP 2 / TP 1 per token | {r['tp2_over_tp1']['tp2_shm']} | {r['tp2_over_tp1']['tp2_ray']} | <= 3 |",
             f"| first round trip after {r['idle_s']:.0f} s idle (ms) | "
             f"{idle['tp2_shm']['first_round_trip_after_idle_ms']} | {idle['tp2_ray']['first_round_trip_after_idle_ms']}"
             " | <= 5 |",
             f"| first decode step after {r['idle_s']:.0f} s idle (ms) | "
             f"{idle['tp2_shm']['first_decode_step_after_idle_ms']} | "
             f"{idle['tp2_ray']['first_decode_step_after_idle_ms']} | |",
             f"| idle rank CPU (% of a core, per rank) | {idle['tp2_shm']['idle_rank_cpu_percent']} | "
             f"{idle['tp2_ray']['idle_rank_cpu_percent']} | <= 5 |"]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
