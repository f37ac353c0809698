"""The serving path's cost: HTTP through Serve against the engine alone, under the same arrivals, alternating.

    .venv/bin/python -m benchmarks.serving_path [--before 7f7b849] [--rounds 2] [--rates 2,8]

Three variants, each a process of its own running both rates (benchmarks.serving's load, 8 adapters):
the engine alone (benchmarks.serving_engine, this tree), HTTP through Serve (this tree) and HTTP
through Serve at the `--before` revision (checked out as benchmarks.ab does; the same driver file
runs with that tree first on the path, so only the served code differs). Rounds alternate the order.
Reported per round and as medians: HTTP TPOT p50 / engine TPOT p50, HTTP / engine output tokens/s,
and CPU seconds per generated token of the ingress replica (also the LLM replica and the HTTP proxy),
read from /proc of each Serve actor around the timed load. Writes results/serving_path.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.ab import checkout
from benchmarks.checkpoint import cache_root
from benchmarks.common import RESULTS, machine_info, median, write_result

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"tpot_ratio": 1.10, "throughput_ratio": 0.95}


def run_variant(variant: str, tree: Path, rates: str, requests: int, log) -> dict:
    out = Path(tempfile.mkstemp(prefix="serving-path-", suffix=".json")[1])
    script = ROOT / "benchmarks" / ("serving_engine.py" if variant == "engine" else "serving.py")
    env = dict(os.environ, PYTHONPATH=str(tree), LORASERVE_BENCH_CACHE=str(cache_root()))
    cmd = [sys.executable, str(script), "--rates", rates, "--adapters", "8", "--requests", str(requests),
           "--out", str(out)]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    log("\n".join(line for line in done.stdout.splitlines() if line.startswith("[")))
    data = json.loads(out.read_text())
    out.unlink()
    return {r["rate"]: r for r in data["runs"]}


def ratios(got: dict, rate: float) -> dict:
    engine, http, before = (got[v][rate]["summary"] for v in ("engine", "http", "http_before"))
    cpu = {v: got[v][rate]["cpu_s_per_token"] for v in ("http", "http_before")}
    return {"tpot_http_over_engine": http["tpot_ms"]["p50"] / engine["tpot_ms"]["p50"],
            "tpot_before_over_engine": before["tpot_ms"]["p50"] / engine["tpot_ms"]["p50"],
            "tok_s_http_over_engine": http["output_tok_s"] / engine["output_tok_s"],
            "tok_s_before_over_engine": before["output_tok_s"] / engine["output_tok_s"],
            **{f"{role}_cpu_s_per_token": {"before": cpu["http_before"].get(role), "after": cpu["http"].get(role)}
               for role in ("ingress", "llm_replica", "proxy")}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="7f7b849")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rates", default="2,8")
    parser.add_argument("--requests", type=int, default=60, help="per rate (the issue's load: 60)")
    args = parser.parse_args(argv)
    trees = {"engine": ROOT, "http": ROOT, "http_before": checkout(args.before)}
    rates = [float(r) for r in args.rates.split(",")]
    rounds = []
    for i in range(args.rounds):
        order = ("engine", "http", "http_before") if i % 2 == 0 else ("http_before", "http", "engine")
        got = {v: run_variant(v, trees[v], args.rates, args.requests, print) for v in order}
        rounds.append({"order": order, "results": got, "ratios": {rate: ratios(got, rate) for rate in rates}})
        print(json.dumps(rounds[-1]["ratios"], indent=1), flush=True)
    data = {"benchmark": "serving_path", "before": args.before, "rates": rates, "num_requests": args.requests,
            "machine": machine_info(), "targets": TARGETS, "rounds": rounds,
            "median": {rate: medians(rounds, rate) for rate in rates}}
    write_result("serving_path", data)
    (RESULTS / "serving_path.md").write_text(section(data))
    print(section(data))
    return data


def medians(rounds: list[dict], rate: float) -> dict:
    def pick(path):
        values = []
        for r in rounds:
            value = r["ratios"][rate]
            for key in path:
                value = value[key]
            values.append(value)
        return median([v for v in values if v is not None])

    out = {key: pick([key]) for key in ("tpot_http_over_engine", "tpot_before_over_engine",
                                        "tok_s_http_over_engine", "tok_s_before_over_engine")}
    for key in ("ingress", "llm_replica", "proxy"):
        out[f"{key}_cpu_s_per_token"] = {side: pick([f"{key}_cpu_s_per_token", side]) for side in ("before", "after")}
    for variant in ("engine", "http", "http_before"):
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
             f"bf16, the settings of benchmarks/common.py. Before = {data['before']}. Medians over rounds.", "",
             "| rate | engine TPOT p50 | HTTP TPOT p50 (after / before) | HTTP / engine TPOT (after / before; "
             f"target <= {TARGETS['tpot_ratio']}) | TTFT p99 engine / after / before | out tok/s engine / after / "
             f"before | HTTP / engine tok/s (after / before) |", "|---|---|---|---|---|---|---|"]
    for rate in data["rates"]:
        m = data["median"][rate]
        e, a, b = m["engine"], m["http"], m["http_before"]
        lines.append(f"| {rate:g} req/s | {e['tpot_p50_ms']:.1f} ms | {a['tpot_p50_ms']:.1f} / {b['tpot_p50_ms']:.1f} "
                     f"ms | **{m['tpot_http_over_engine']:.2f}** / {m['tpot_before_over_engine']:.2f} | "
                     f"{e['ttft_p99_ms']:.0f} / {a['ttft_p99_ms']:.0f} / {b['ttft_p99_ms']:.0f} ms | "
                     f"{e['output_tok_s']:.1f} / {a['output_tok_s']:.1f} / {b['output_tok_s']:.1f} | "
                     f"**{m['tok_s_http_over_engine']:.2f}** / {m['tok_s_before_over_engine']:.2f} |")
    lines += ["", "CPU milliseconds per generated token (process CPU of each Serve actor during the timed load):", "",
              "| rate | ingress before / after | LLM replica before / after | HTTP proxy before / after |",
              "|---|---|---|---|"]
    for rate in data["rates"]:
        m = data["median"][rate]
        cells = [f"{1e3 * m[f'{k}_cpu_s_per_token']['before']:.2f} / {1e3 * m[f'{k}_cpu_s_per_token']['after']:.2f}"
                 for k in ("ingress", "llm_replica", "proxy")]
        lines.append(f"| {rate:g} req/s | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
