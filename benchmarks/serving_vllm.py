"""The serving load over HTTP against ours and vLLM's CPU build, alternating processes, at several rates.

    .venv/bin/python -m benchmarks.serving_vllm [--pairs 3] [--rates 2,8]

Each pair runs both systems (order alternating), each a process of its own serving the rates in turn
(benchmarks.serving's load with 8 adapters; the same requests and the same warm-up for both; vLLM as
benchmarks/peer_vllm.py starts it). Reports TPOT p50 and TTFT p99 per pair and their medians; writes
results/serving_vllm.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from dataclasses import replace

from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import FULL, RESULTS, machine_info, median, write_result
from benchmarks.peer_vllm import vllm_server, wait_healthy
from benchmarks.serving import ServingLoad, drive, loads_at, make_requests, summarize, warm_requests
from benchmarks.serving_path import ROOT, run_variant
from benchmarks.throughput import adapter_name


def run_vllm(load: ServingLoad, rates: tuple[float, ...], dtype: str = "bfloat16", log=print) -> dict:
    from workers.ray_utils import free_port

    sizes = FULL
    model, paths = build_checkpoint(dtype, sizes.shape), build_adapters(load.num_adapters, sizes.shape, sizes.rank)
    port = free_port()
    server = vllm_server(model, dtype, sizes, paths, port, load.input_range[1] + load.output_range[1] + 16, log)
    url, out = f"http://127.0.0.1:{port}", {}
    try:
        wait_healthy(server, url)
        naming = lambda adapter: "bench" if adapter is None else adapter_name(adapter)  # noqa: E731
        asyncio.run(drive(url, warm_requests(load, sizes), naming))
        for timed in loads_at(load, rates):
            results, wall = asyncio.run(drive(url, make_requests(timed, sizes.shape.vocab_size), naming))
            out[timed.rate] = summarize(results, wall)
            log(f"[vllm serving] {timed.rate}/s: TPOT p50 {out[timed.rate]['tpot_ms']['p50']:.1f} ms, TTFT p99 "
                f"{out[timed.rate]['ttft_ms']['p99']:.0f} ms, {out[timed.rate]['failed']} failed")
    finally:
        os.killpg(server.pid, signal.SIGTERM)   # the server and its engine-core process, started by us
        server.wait(timeout=60)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rates", default="2,8")
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args(argv)
    rates = tuple(float(r) for r in args.rates.split(","))
    load = replace(ServingLoad(), num_adapters=8, num_requests=args.requests)
    pairs = []
    for i in range(args.pairs):
        got = {}
        for system in (("vllm", "ours") if i % 2 == 0 else ("ours", "vllm")):
            if system == "vllm":
                got["vllm"] = run_vllm(load, rates)
            else:
                got["ours"] = {rate: r["summary"] for rate, r in
                               run_variant("http", ROOT, args.rates, args.requests, print).items()}
        pairs.append(got)
    data = {"benchmark": "serving_vllm", "rates": list(rates), "num_requests": args.requests,
            "machine": machine_info(), "pairs": pairs,
            "median": {rate: {system: {"tpot_p50_ms": median([p[system][rate]["tpot_ms"]["p50"] for p in pairs]),
                                       "ttft_p99_ms": median([p[system][rate]["ttft_ms"]["p99"] for p in pairs]),
                                       "output_tok_s": median([p[system][rate]["output_tok_s"] for p in pairs])}
                              for system in ("ours", "vllm")} for rate in rates}}
    write_result("serving_vllm", data)
    (RESULTS / "serving_vllm.md").write_text(section(data))
    print(section(data))
    return data


def section(data: dict) -> str:
    lines = ["### Serving over HTTP: ours against vLLM's CPU build", "",
             f"benchmarks/serving_vllm.py: {len(data['pairs'])} pairs of processes, order alternating; "
             f"{data['num_requests']} streamed requests per rate, Poisson arrivals, 8 adapters, bench checkpoint "
             "bf16. Medians over pairs (per pair: ours / vLLM).", "",
             "| rate | TPOT p50 ours / vLLM | TTFT p99 ours / vLLM | out tok/s ours / vLLM | per pair TPOT p50 |",
             "|---|---|---|---|---|"]
    for rate in data["rates"]:
        m = data["median"][rate]
        o, v = m["ours"], m["vllm"]
        per_pair = ", ".join(f"{p['ours'][rate]['tpot_ms']['p50']:.0f} / {p['vllm'][rate]['tpot_ms']['p50']:.0f}"
                             for p in data["pairs"])
        lines.append(f"| {rate:g} req/s | {o['tpot_p50_ms']:.1f} / {v['tpot_p50_ms']:.1f} ms | "
                     f"{o['ttft_p99_ms']:.0f} / {v['ttft_p99_ms']:.0f} ms | {o['output_tok_s']:.1f} / "
                     f"{v['output_tok_s']:.1f} | {per_pair} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
