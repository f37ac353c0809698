"""The serving path's cost: HTTP through Serve against the engine alone, under the same arrivals, alternating.

    .venv/bin/python -m benchmarks.serving_path [--rounds 2] [--rates 2,8]

Four variants, each a process of its own running both rates (benchmarks.serving's load, 8 adapters):
the engine alone (benchmarks.serving_engine: the replica's engine, one core left to Serve, on a thread of
the benchmark's process; and again on every core), HTTP through Serve as served (the replica's engine in a
process of its own, LLMConfig.engine_process) and HTTP through Serve with the engine on a thread of the
replica (`--no-engine-process`), both with the Ray settings of workers/ray_utils.py SERVING_RAY_ENV.
Rounds alternate the order.
Reported per round and as medians: HTTP TPOT p50 / engine TPOT p50, HTTP / engine output tokens/s,
and CPU seconds per generated token of the ingress replica (also the LLM replica with its engine process,
and the HTTP proxy), read from /proc of each Serve actor around the timed load. Writes
results/serving_path.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.checkpoint import cache_root
from benchmarks.common import RESULTS, machine_info, median, write_result

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"tpot_ratio": 1.10, "throughput_ratio": 0.95}
VARIANTS = ("engine", "http", "http_engine_thread", "engine_all_cores")
HTTP = VARIANTS[1:3]
FLAGS = {"engine_all_cores": ["--cpu-reserved-cores", "0"], "http_engine_thread": ["--engine-thread"]}


def run_variant(variant: str, rates: str, requests: int, log) -> dict:
    """One variant's process (the engine alone starts no Ray)."""
    out = Path(tempfile.mkstemp(prefix="serving-path-", suffix=".json")[1])
    script = ROOT / "benchmarks" / ("serving_engine.py" if variant.startswith("engine") else "serving.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT), LORASERVE_BENCH_CACHE=str(cache_root()))
    cmd = [sys.executable, str(script), "--rates", rates, "--adapters", "8", "--requests", str(requests),
           "--out", str(out)] + FLAGS.get(variant, [])
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    log("\n".join(line for line in done.stdout.splitlines() if line.startswith("[")))
    data = json.loads(out.read_text())
    out.unlink()
    return {r["rate"]: r for r in data["runs"]}


def ratios(got: dict, rate: float) -> dict:
    engine = got["engine"][rate]["summary"]
    out = {}
    for v in HTTP:
        summary = got[v][rate]["summary"]
        out[f"tpot_{v}_over_engine"] = summary["tpot_ms"]["p50"] / engine["tpot_ms"]["p50"]
        out[f"tok_s_{v}_over_engine"] = summary["output_tok_s"] / engine["output_tok_s"]
        for role in ("ingress", "llm_replica", "proxy"):
            out[f"{role}_cpu_s_per_token_{v}"] = got[v][rate]["cpu_s_per_token"].get(role)
    all_cores, http = got["engine_all_cores"][rate]["summary"], got["http"][rate]["summary"]
    out["tpot_http_over_engine_all_cores"] = http["tpot_ms"]["p50"] / all_cores["tpot_ms"]["p50"]
    out["tok_s_http_over_engine_all_cores"] = http["output_tok_s"] / all_cores["output_tok_s"]
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rates", default="2,8")
    parser.add_argument("--requests", type=int, default=60, help="per rate (the issue's load: 60)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    rounds = []
    for i in range(args.rounds):
        order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
        got = {v: run_variant(v, args.rates, args.requests, print) for v in order}
        rounds.append({"order": order, "results": got, "ratios": {rate: ratios(got, rate) for rate in rates}})
        print(json.dumps(rounds[-1]["ratios"], indent=1), flush=True)
    data = {"benchmark": "serving_path", "rates": rates, "num_requests": args.requests,
            "machine": machine_info(), "targets": TARGETS, "rounds": rounds,
            "median": {rate: medians(rounds, rate) for rate in rates}}
    write_result("serving_path", data)
    (RESULTS / "serving_path.md").write_text(section(data))
    print(section(data))
    return data


def medians(rounds: list[dict], rate: float) -> dict:
    keys = rounds[0]["ratios"][rate]
    out = {key: median([v for v in (r["ratios"][rate][key] for r in rounds) if v is not None]) for key in keys}
    for variant in VARIANTS:
        summaries = [r["results"][variant][rate]["summary"] for r in rounds]
        out[variant] = {"tpot_p50_ms": median([s["tpot_ms"]["p50"] for s in summaries]),
                        "ttft_p99_ms": median([s["ttft_ms"]["p99"] for s in summaries]),
                        "output_tok_s": median([s["output_tok_s"] for s in summaries]),
                        "failed": sum(s["failed"] for s in summaries)}
    return out


def section(data: dict) -> str:
    """RESULTS.md's section (kept as results/serving_path.md, see benchmarks/report.py)."""
    lines = ["### The serving path: HTTP through Serve against the engine alone", "",
             f"benchmarks/serving_path.py: {len(data['rounds'])} rounds, variants alternated in each; "
             f"{data['num_requests']} streamed requests per rate, Poisson arrivals, 8 adapters, bench checkpoint "
             "bf16, the settings of benchmarks/common.py, the Ray settings of docs/deployment.md \"Ray settings\". HTTP = as "
             "served: the replica's engine in a process of its own (`engine_process`); engine thread = "
             "`--no-engine-process`. The engine alone is the replica's engine (the same LLMConfig: one core left "
             "to Serve, `cpu_reserved_cores`) on a thread of the benchmark; the last columns set it on every "
             "core. Medians over rounds.", "",
             "| rate | engine TPOT p50 | HTTP TPOT p50 (HTTP / engine thread) | HTTP / engine TPOT (target "
             f"<= {TARGETS['tpot_ratio']}) | TTFT p99 engine / HTTP / engine thread | out tok/s engine / "
             f"HTTP / engine thread | HTTP / engine tok/s (target >= {TARGETS['throughput_ratio']}) | "
             "engine on every core: TPOT p50, HTTP / it TPOT, HTTP / it tok/s |",
             "|---|---|---|---|---|---|---|---|"]
    for rate in data["rates"]:
        m = data["median"][rate]
        e = m["engine"]
        tpot = " / ".join(f"{m[v]['tpot_p50_ms']:.1f}" for v in HTTP)
        tpot_ratio = " / ".join(f"{m[f'tpot_{v}_over_engine']:.2f}" for v in HTTP)
        ttft = " / ".join(f"{m[v]['ttft_p99_ms']:.0f}" for v in VARIANTS[:3])
        tok = " / ".join(f"{m[v]['output_tok_s']:.1f}" for v in VARIANTS[:3])
        tok_ratio = " / ".join(f"{m[f'tok_s_{v}_over_engine']:.2f}" for v in HTTP)
        a = m["engine_all_cores"]
        lines.append(f"| {rate:g} req/s | {e['tpot_p50_ms']:.1f} ms | {tpot} ms | **{tpot_ratio}** | {ttft} ms | "
                     f"{tok} | **{tok_ratio}** | {a['tpot_p50_ms']:.1f} ms, "
                     f"{m['tpot_http_over_engine_all_cores']:.2f}, {m['tok_s_http_over_engine_all_cores']:.2f} |")
    lines += ["", "CPU milliseconds per generated token (process CPU of each Serve actor during the timed load, the "
              "replica's with its engine process; HTTP / engine thread):", "",
              "| rate | ingress | LLM replica | HTTP proxy |", "|---|---|---|---|"]
    for rate in data["rates"]:
        m = data["median"][rate]
        cells = [" / ".join(f"{1e3 * m[f'{k}_cpu_s_per_token_{v}']:.2f}" for v in HTTP)
                 for k in ("ingress", "llm_replica", "proxy")]
        lines.append(f"| {rate:g} req/s | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
