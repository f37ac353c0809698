"""The serving load over HTTP against ours and vLLM's CPU build, alternating processes, at several rates.

    .venv/bin/python -m benchmarks.serving_vllm [--pairs 3] [--rates 2,8]

Each pair runs every system (order rotating), each a process of its own serving the rates in turn
(benchmarks.serving's load with 8 adapters; the same requests and the same warm-up for all): ours, and
vLLM as benchmarks/peer_vllm.py starts it twice: its OpenMP threads on every core, and on every core but
one, left to its API server (`VLLM_CPU_OMP_THREADS_BIND`; its docs advise leaving cores to the serving
front end, as our replica's `cpu_reserved_cores` does). Reports TPOT p50 and TTFT p99 per pair and their
medians, ours against the better vLLM; writes results/serving_vllm.{json,md}.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
from dataclasses import replace

from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import FULL, RESULTS, machine_info, median, write_result
from benchmarks.peer_vllm_serving import vllm_server, wait_healthy
from benchmarks.serving import ServingLoad, drive, loads_at, make_requests, summarize, warm_requests
from benchmarks.serving_path import run_variant
from benchmarks.throughput import adapter_name


VLLM_SYSTEMS = {"vllm": None, "vllm_reserved": "0"}   # system -> VLLM_CPU_OMP_THREADS_BIND (None: every core)
SYSTEMS = ("ours", *VLLM_SYSTEMS)


def run_vllm(load: ServingLoad, rates: tuple[float, ...], dtype: str = "bfloat16", log=print,
             omp_bind: str | None = None) -> dict:
    from workers.ray_utils import free_port

    sizes = FULL
    model, paths = build_checkpoint(dtype, sizes.shape), build_adapters(load.num_adapters, sizes.shape, sizes.rank)
    port = free_port()
    server = vllm_server(model, dtype, sizes, paths, port, load.input_range[1] + load.output_range[1] + 16, log,
                         omp_bind)
    url, out = f"http://127.0.0.1:{port}", {}
    try:
        wait_healthy(server, url)
        naming = lambda adapter: "bench" if adapter is None else adapter_name(adapter)  # noqa: E731
        asyncio.run(drive(url, warm_requests(load, sizes), naming))
        for timed in loads_at(load, rates):
            results, wall = asyncio.run(drive(url, make_requests(timed, sizes.shape.vocab_size), naming))
            got = out[timed.rate] = summarize(results, wall)
            log(f"[vllm serving, bind {omp_bind or 'all'}] {timed.rate}/s: TPOT p50 {got['tpot_ms']['p50']:.1f} ms, "
                f"TTFT p99 {got['ttft_ms']['p99']:.0f} ms, {got['failed']} failed")
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
        for system in SYSTEMS[i % len(SYSTEMS):] + SYSTEMS[:i % len(SYSTEMS)]:
            if system == "ours":
                got["ours"] = {rate: r["summary"] for rate, r in
                               run_variant("http", args.rates, args.requests, print).items()}
            else:
                got[system] = run_vllm(load, rates, omp_bind=VLLM_SYSTEMS[system])
        pairs.append(got)
    data = {"benchmark": "serving_vllm", "rates": list(rates), "num_requests": args.requests,
            "machine": machine_info(), "pairs": pairs,
            "median": {rate: {system: {"tpot_p50_ms": median([p[system][rate]["tpot_ms"]["p50"] for p in pairs]),
                                       "ttft_p99_ms": median([p[system][rate]["ttft_ms"]["p99"] for p in pairs]),
                                       "output_tok_s": median([p[system][rate]["output_tok_s"] for p in pairs])}
                              for system in SYSTEMS} for rate in rates}}
    write_result("serving_vllm", data)
    (RESULTS / "serving_vllm.md").write_text(section(data))
    print(section(data))
    return data


def section(data: dict) -> str:
    lines = ["### Serving over HTTP: ours against vLLM's CPU build", "",
             f"benchmarks/serving_vllm.py: {len(data['pairs'])} rounds of processes, order rotating; "
             f"{data['num_requests']} streamed requests per rate, Poisson arrivals, 8 adapters, bench checkpoint "
             "bf16. vLLM twice: OpenMP on every core, and on every core but one (left to its API server). "
             "Medians over rounds.", "",
             "| rate | TPOT p50 ours / vLLM all cores / vLLM one left | TTFT p99 ours / vLLM / vLLM one left | "
             "out tok/s ours / vLLM / vLLM one left | per round TPOT p50 |", "|---|---|---|---|---|"]
    for rate in data["rates"]:
        m = data["median"][rate]
        cell = lambda key, fmt: " / ".join(format(m[s][key], fmt) for s in SYSTEMS)  # noqa: E731
        per_round = ", ".join(" / ".join(f"{p[s][rate]['tpot_ms']['p50']:.0f}" for s in SYSTEMS)
                              for p in data["pairs"])
        lines.append(f"| {rate:g} req/s | {cell('tpot_p50_ms', '.1f')} ms | {cell('ttft_p99_ms', '.0f')} ms | "
                     f"{cell('output_tok_s', '.1f')} | {per_round} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
