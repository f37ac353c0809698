"""What serving costs in CPU outside the engine, for the fleet simulation's validation (benchmarks/fleet_validate.py).

    .venv/bin/python -m benchmarks.fleet_path_cpu [--requests 40]

The real fleet benchmark's application (benchmarks/fleet.py `app_config`: its replicas, adapters and limits, our
routing) on a loopback Ray + Serve of its own; CPU seconds of every process of that Ray session and of this
driver (the client) from /proc (benchmarks/procfs.py), which, unlike latencies, another user's load on the
machine barely changes:
- idle: the session with no request, `--idle-s` seconds (Ray's and Serve's own loops, the replicas' heartbeats
  and prefetch): the fleet's own background, in cores;
- one request at a time, `--requests` of them, 1 output token, then as many with `--tokens` output tokens (prompts
  of 8 tokens, adapters drawn in turn, every request answered before the next is sent): CPU per request and per
  further token, less the idle rate over the same time; then as many 1-token requests again, the server's CPU
  read when the first token reaches the client too: what of a request's work comes before its first token.
Their engine part is the calibration's (results/fleet_calibration.json): what is left is the serving path's work
per request and per streamed token. Also the TTFT of a lone request (median). Writes results/fleet_path_cpu.json.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from benchmarks.common import local_serve, machine_info, write_result
from benchmarks.fleet_workload import FLEET, Request


def tree_cpu_s(client: bool = True) -> float:
    """CPU seconds so far of this session's processes (Ray's, Serve's, the replicas' engines) and the client's."""
    from benchmarks.procfs import process_cpu_seconds, process_tree

    return sum(process_cpu_seconds(pid) for pid in process_tree(os.getpid()) if client or pid != os.getpid())


def split(url: str, names: list[str], count: int, vocab_size: int, idle_cores: float) -> list[tuple[float, float]]:
    """(CPU seconds until the first token reached the client, CPU seconds after it, until 0.2 s after the end) of
    `count` lone 1-token requests, the server's processes only (the client reads /proc in between), less the
    idle rate. The reading at the first token comes a few ms late: an upper bound on the share before it."""
    import aiohttp

    from benchmarks.fleet import BASE
    from benchmarks.fleet_client import prompt_ids

    async def one(session, i: int) -> tuple[float, float]:
        body = {"model": f"{BASE}:{names[i % len(names)]}", "prompt": prompt_ids(i, 8, vocab_size, 3),
                "max_tokens": 1, "temperature": 0.0, "ignore_eos": True, "stream": True}
        cpu0, t0 = tree_cpu_s(client=False), time.perf_counter()
        cpu1 = t1 = None
        async with session.post(f"{url}/v1/completions", json=body) as response:
            async for raw in response.content:
                if cpu1 is None and raw.startswith(b"data:") and b"choices" in raw:
                    cpu1, t1 = tree_cpu_s(client=False), time.perf_counter()
        await asyncio.sleep(0.2)
        cpu2, t2 = tree_cpu_s(client=False), time.perf_counter()
        return cpu1 - cpu0 - idle_cores * (t1 - t0), cpu2 - cpu1 - idle_cores * (t2 - t1)

    async def run() -> list[tuple[float, float]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            return [await one(session, i) for i in range(count)]

    return asyncio.run(run())


def one_at_a_time(url: str, names: list[str], count: int, tokens: int, vocab_size: int, seed: int) -> tuple:
    """(CPU seconds, wall seconds, records) of `count` lone requests, on one client session (as fleet.py's)."""
    import aiohttp

    from benchmarks.fleet import BASE
    from benchmarks.fleet_client import one_request, prompt_ids

    async def run() -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            out = []
            for i in range(count):
                start = time.perf_counter()
                out.append(await one_request(session, url, BASE, Request(0.0, names[i % len(names)], 8, tokens),
                                             prompt_ids(i, 8, vocab_size, seed), start, start + 30.0))
            return out

    cpu0, wall0 = tree_cpu_s(), time.perf_counter()
    records = asyncio.run(run())
    return tree_cpu_s() - cpu0, time.perf_counter() - wall0, records


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=33)
    parser.add_argument("--idle-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    from transformers import AutoConfig

    from benchmarks.fleet import app_config, app_name
    from benchmarks.fleet_adapters import ensure_fleet_adapters

    model_dir, adapters = ensure_fleet_adapters(FLEET)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    routing = "adapter-affinity"
    with local_serve("lsfp-", 2 * FLEET.replicas + 2) as url:
        from ray import serve

        from deployments.app import build_app
        serve.run(build_app(app_config(routing, model_dir, adapters, FLEET)), name=app_name(routing),
                  route_prefix=f"/{app_name(routing)}")
        url = f"{url}/{app_name(routing)}"
        names = sorted(adapters)
        one_at_a_time(url, names, 8, 2, vocab_size, seed=99)   # first requests: connections, imports
        time.sleep(3.0)
        cpu0, wall0 = tree_cpu_s(), time.perf_counter()
        time.sleep(args.idle_s)
        idle_cores = (tree_cpu_s() - cpu0) / (time.perf_counter() - wall0)
        short = one_at_a_time(url, names, args.requests, 1, vocab_size, seed=1)
        long = one_at_a_time(url, names, args.requests, args.tokens, vocab_size, seed=2)
        halves = split(url, names, args.requests, vocab_size, idle_cores)
    per_request = [(cpu - idle_cores * wall) / args.requests for cpu, wall, _ in (short, long)]
    records = short[2] + long[2]
    result = {"what": __doc__.split("\n\n")[0], "fleet": FLEET.__dict__, "routing": routing,
              "requests": args.requests, "tokens": args.tokens, "idle_cores": idle_cores,
              "cpu_s_per_request": per_request[0],
              "cpu_s_per_further_token": (per_request[1] - per_request[0]) / (args.tokens - 1),
              "server_cpu_s_until_first_token_p50": statistics.median(b for b, _ in halves),
              "server_cpu_s_after_first_token_p50": statistics.median(a for _, a in halves),
              "lone_ttft_p50_s": statistics.median(r["first"] - r["sent"] for r in records if r["first"] is not None),
              "not_ok": sum(r["outcome"] != "ok" for r in records),
              "machine": machine_info(), "load_avg_1m_after": os.getloadavg()[0]}
    print(write_result("fleet_path_cpu", result))
    return result


if __name__ == "__main__":
    main()
