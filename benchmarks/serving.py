"""Serving over HTTP: open-loop arrivals against the OpenAI API of `deployments.app.build_app`.

    .venv/bin/python -m benchmarks.serving [--rate 2] [--cv 1] [--requests 60] [--adapters 64]

S-LoRA's workload generator (fixed seed): adapter = floor(power(alpha) * n), prompt and
output lengths uniform in their ranges, inter-arrival times Gamma(1/cv^2, cv^2/rate)
(cv = 1 is Poisson), a bounded number of requests. Each request is a streamed
/v1/completions call with a token-id prompt, greedy, ignore_eos. Reports TTFT (first
streamed token) and TPOT ((last - first) / (tokens - 1)) p50 / p99, output tokens/s
over the whole run, and failures. Ray, Serve and HTTP stay on 127.0.0.1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, replace

from benchmarks.checkpoint import ALL7, build_adapters, build_checkpoint
from benchmarks.common import FULL, Sizes, local_serve, machine_info, sizes_dict, write_result
from benchmarks.hotload import percentile
from benchmarks.procfs import process_cpu_seconds, process_tree


@dataclass(frozen=True)
class ServingLoad:
    rate: float = 2.0                    # requests/s
    cv: float = 1.0                      # coefficient of variation of inter-arrival times
    num_requests: int = 60
    num_adapters: int = 64
    alpha: float = 0.3
    input_range: tuple[int, int] = (16, 48)
    output_range: tuple[int, int] = (16, 48)
    base_fraction: float = 0.0           # share of requests for the base model
    seed: int = 42


def make_requests(load: ServingLoad, vocab_size: int) -> list[dict]:
    """S-LoRA's generator: (arrival time, adapter index or None, prompt ids, output length) per request."""
    import numpy as np

    rng = np.random.default_rng(load.seed)
    n = load.num_requests
    adapters = np.minimum((rng.power(load.alpha, n) * load.num_adapters).astype(int), load.num_adapters - 1)
    base = rng.random(n) < load.base_fraction
    inputs = rng.integers(load.input_range[0], load.input_range[1], n)
    outputs = rng.integers(load.output_range[0], load.output_range[1], n)
    gaps = rng.gamma(1 / load.cv ** 2, load.cv ** 2 / load.rate, n)
    arrivals = np.cumsum(gaps)
    return [{"arrival": float(arrivals[i]), "adapter": None if base[i] else int(adapters[i]),
             "prompt": rng.integers(2, vocab_size, int(inputs[i])).tolist(), "max_tokens": int(outputs[i])}
            for i in range(n)]


def timed(result: dict, first: float | None, last: float | None, sent: float, start: float, missing: str) -> dict:
    """A request's result: TTFT from when it was sent, TPOT over its streamed tokens; `missing` if none came."""
    if first is None:
        result["error"] = missing
        return result
    result.update(ok=True, ttft_s=first - sent, end_s=last - start,
                  tpot_s=(last - first) / (result["tokens"] - 1) if result["tokens"] > 1 else None)
    return result


async def one_request(session, url: str, model: str, request: dict, start: float) -> dict:
    """Stream one completion; times measured from the request's scheduled arrival."""
    await asyncio.sleep(max(0.0, start + request["arrival"] - time.perf_counter()))
    sent = time.perf_counter()
    body = {"model": model, "prompt": request["prompt"], "max_tokens": request["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = {"ok": False, "tokens": 0, "ttft_s": None, "tpot_s": None, "error": None}
    first = last = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result["error"] = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result["error"] = str(event["error"])[:200]
                    return result
                if event.get("choices") and event["choices"][0].get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                if event.get("usage"):
                    result["tokens"] = event["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001  (a failed request is counted, not raised)
        result["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return result
    return timed(result, first, last, sent, start, "no tokens streamed")


def model_name(base_model: str, adapter: int | None) -> str:
    return base_model if adapter is None else f"{base_model}:lora-{adapter:04d}"


async def drive(url: str, requests: list[dict], naming) -> tuple[list[dict], float]:
    """Send every request at its arrival time; `naming(adapter index or None)` is the request's `model`."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        tasks = [one_request(session, url, naming(r["adapter"]), r, start) for r in requests]
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] * 1e3 for r in ok]
    tpot = [r["tpot_s"] * 1e3 for r in ok if r["tpot_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)

    def p50_p99(values):
        return {"p50": percentile(values, 50), "p99": percentile(values, 99)} if values else {"p50": None, "p99": None}

    return {"ttft_ms": p50_p99(ttft), "tpot_ms": p50_p99(tpot), "output_tok_s": tokens / wall, "wall_s": wall,
            "output_tokens": tokens,
            "failed": len(results) - len(ok), "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def bench_config(model_dir, paths, load: ServingLoad, sizes: Sizes, dtype: str, engine_process: bool = True) -> dict:
    """LLMConfig arguments of the served model; the engine-alone mode builds its engine from the same.
    `engine_process`: False runs the replica's engine on a thread of the replica (LLMConfig.engine_process)."""
    return dict(model=str(model_dir), served_model_name="bench", device="cpu", dtype=dtype, num_replicas=1,
                engine_process=engine_process,
                adapters={f"lora-{i:04d}": str(p) for i, p in enumerate(paths)},
                max_num_seqs=sizes.batch, max_loras_per_batch=sizes.max_loras_per_batch,
                max_loaded_loras=sizes.max_loaded_loras, max_lora_rank=sizes.rank,
                max_model_len=load.input_range[1] + load.output_range[1] + 16,
                max_ongoing_requests=max(64, load.num_requests),
                engine_kwargs={"lora_target_modules": ALL7, "kv_cache_memory_gb": 1.0})


def run(sizes: Sizes = FULL, load: ServingLoad = ServingLoad(), dtype: str = "bfloat16", log=print,
        rates: tuple[float, ...] | None = None, engine_process: bool = True) -> dict:
    """One deployment; the load at each of `rates` (default: load.rate) after one warm-up."""
    model_dir = build_checkpoint(dtype, sizes.shape)
    paths = build_adapters(load.num_adapters, sizes.shape, sizes.rank)
    runs = []
    with local_serve("lsb-", max(2, os.cpu_count() or 2)) as url:
        from ray import serve

        from deployments.app import build_app
        started = time.perf_counter()
        app = build_app(bench_config(model_dir, paths, load, sizes, dtype, engine_process))
        serve.run(app, name="bench", route_prefix="/", blocking=False)
        log(f"[serving] deployed in {time.perf_counter() - started:.0f} s")
        naming = lambda adapter: model_name("bench", adapter)  # noqa: E731
        asyncio.run(drive(url, warm_requests(load, sizes), naming))   # first-call costs stay out of the timings
        for timed in loads_at(load, rates):
            requests = make_requests(timed, sizes.shape.vocab_size)
            cpu_before = serve_cpu_seconds()
            results, wall = asyncio.run(drive(url, requests, naming))
            cpu = {k: v - cpu_before.get(k, 0.0) for k, v in serve_cpu_seconds().items()}
            runs.append(dict(rate=timed.rate, summary=summarize(results, wall), cpu_s=cpu))
    for r in runs:
        summary, tokens = r["summary"], r["summary"]["output_tokens"]
        r["cpu_s_per_token"] = {k: v / tokens for k, v in r["cpu_s"].items()} if tokens else {}
        log(f"[serving] {r['rate']}/s: TTFT p50 {summary['ttft_ms']['p50']} ms, TPOT p50 "
            f"{summary['tpot_ms']['p50']} ms, {summary['output_tok_s']:.1f} tok/s, {summary['failed']} failed, "
            f"ingress CPU {r['cpu_s'].get('ingress', 0):.2f} s")
    data = {"benchmark": "serving", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "rate": load.rate, "cv": load.cv, "num_requests": load.num_requests, "num_adapters": load.num_adapters,
            "alpha": load.alpha, "input_range": list(load.input_range), "output_range": list(load.output_range)}
    return dict(data, summary=runs[0]["summary"], runs=runs) if len(runs) == 1 else dict(data, runs=runs)


def loads_at(load: ServingLoad, rates: tuple[float, ...] | None) -> list[ServingLoad]:
    """The timed loads of one process: each rate with its own seed, so no run finds the prompts of an
    earlier one in the prefix cache (engine-alone and HTTP get the same list)."""
    return [replace(load, rate=rate, seed=load.seed + i) for i, rate in enumerate(rates or (load.rate,))]


def warm_requests(load: ServingLoad, sizes: Sizes) -> list[dict]:
    """Two requests at once, from another seed than the timed ones (their prompts are not in the prefix cache)."""
    return [replace_arrival(r, 0.0) for r in make_requests(replace(load, seed=load.seed + 1000),
                                                           sizes.shape.vocab_size)[:2]]


def serve_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of the Serve processes: ingress, LLM replica (with its engine process),
    HTTP proxy."""
    from ray._private import state

    roles = {"OpenAIIngress": "ingress", "LLMServer": "llm_replica", "ProxyActor": "proxy"}
    out: dict[str, float] = {}
    for actor in state.actors().values():
        role = next((r for key, r in roles.items() if key in actor["ActorClassName"]), None)
        if role is not None and actor["State"] == "ALIVE":
            out[role] = out.get(role, 0.0) + sum(map(process_cpu_seconds, process_tree(actor["Pid"])))
    return out


def replace_arrival(request: dict, arrival: float) -> dict:
    return dict(request, arrival=arrival)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = ServingLoad()
    parser.add_argument("--rate", type=float, default=defaults.rate)
    parser.add_argument("--rates", default=None, help="several rates against one deployment, e.g. 2,8")
    parser.add_argument("--cv", type=float, default=defaults.cv)
    parser.add_argument("--requests", type=int, default=defaults.num_requests)
    parser.add_argument("--adapters", type=int, default=defaults.num_adapters)
    parser.add_argument("--alpha", type=float, default=defaults.alpha)
    parser.add_argument("--out", default=None, help="write the result here (default results/serving_bfloat16.json)")
    parser.add_argument("--engine-thread", action="store_true",
                        help="the replica's engine on a thread of the replica, not in a process of its own")
    args = parser.parse_args(argv)
    load = replace(defaults, rate=args.rate, cv=args.cv, num_requests=args.requests, num_adapters=args.adapters,
                   alpha=args.alpha)
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else None
    data = run(FULL, load, rates=rates, engine_process=not args.engine_thread)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    else:
        print(write_result("serving_bfloat16", data))
    return data


if __name__ == "__main__":
    main()
