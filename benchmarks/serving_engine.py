"""The serving benchmark's load against the engine alone: AsyncLLMEngine in this process, no Ray, no HTTP.

    .venv/bin/python -m benchmarks.serving_engine [--rates 2,8] [--adapters 8] [--out FILE]

The same arrivals as benchmarks.serving (same generator, seeds and requests), the engine built from
the same LLMConfig (`serving.bench_config`, its replica's EngineConfig) with the same adapters, and the
same measures: TTFT to the first output with text, TPOT (last - first) / (tokens - 1), output tokens/s
over the run. What HTTP adds on top of this is the serving path's cost (benchmarks/serving_path.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace

from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import FULL, Sizes, machine_info, sizes_dict
from benchmarks.serving import ServingLoad, bench_config, loads_at, make_requests, summarize, timed, warm_requests


async def one_request(engine, request: dict, start: float, name: str | None) -> dict:
    from workers.config import SamplingParams

    await asyncio.sleep(max(0.0, start + request["arrival"] - time.perf_counter()))
    sent = time.perf_counter()
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
    result = {"ok": False, "tokens": 0, "ttft_s": None, "tpot_s": None, "error": None}
    first = last = None
    try:
        async for out in engine.generate(request["prompt"], params, name, delta=True):
            result["tokens"] += len(out.token_ids)
            if out.text:
                last = time.perf_counter()
                first = first or last
    except Exception as exc:  # noqa: BLE001  (a failed request is counted, not raised)
        result["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return result
    return timed(result, first, last, sent, start, "no text generated")


async def drive(engine, requests: list[dict], naming) -> tuple[list[dict], float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(one_request(engine, r, start, naming(r["adapter"])) for r in requests))
    return list(results), time.perf_counter() - start


def run(sizes: Sizes = FULL, load: ServingLoad = ServingLoad(num_adapters=8), dtype: str = "bfloat16",
        rates: tuple[float, ...] | None = None, log=print, cpu_reserved_cores: int | None = None) -> dict:
    """`cpu_reserved_cores`: None = the replica's engine setting (what the same LLMConfig gives a replica)."""
    from deployments.config import LLMConfig
    from workers.engine_process import start_engine

    model_dir = build_checkpoint(dtype, sizes.shape)
    paths = build_adapters(load.num_adapters, sizes.shape, sizes.rank)
    config = LLMConfig(**bench_config(model_dir, paths, load, sizes, dtype))
    if cpu_reserved_cores is not None:
        config = config.model_copy(update={"engine_kwargs": {**config.engine_kwargs,
                                                             "cpu_reserved_cores": cpu_reserved_cores}})
    engine = start_engine(config.replica_engine_config(), config.adapters, own_process=False)
    naming = lambda adapter: None if adapter is None else f"lora-{adapter:04d}"  # noqa: E731
    runs = []
    try:
        asyncio.run(drive(engine, warm_requests(load, sizes), naming))
        for timed in loads_at(load, rates):
            results, wall = asyncio.run(drive(engine, make_requests(timed, sizes.shape.vocab_size), naming))
            summary = summarize(results, wall)
            runs.append({"rate": timed.rate, "summary": summary})
            log(f"[engine alone] {timed.rate}/s: TTFT p50 {summary['ttft_ms']['p50']} ms, TPOT p50 "
                f"{summary['tpot_ms']['p50']} ms, {summary['output_tok_s']:.1f} tok/s, {summary['failed']} failed")
    finally:
        engine.close()
    return {"benchmark": "serving_engine", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "num_requests": load.num_requests, "num_adapters": load.num_adapters, "runs": runs}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="2,8")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=ServingLoad().num_requests)
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    parser.add_argument("--cpu-reserved-cores", type=int, default=None,
                        help="default: the replica's (1); 0 computes on every core")
    args = parser.parse_args(argv)
    load = replace(ServingLoad(), num_adapters=args.adapters, num_requests=args.requests)
    data = run(FULL, load, rates=tuple(float(r) for r in args.rates.split(",")),
               cpu_reserved_cores=args.cpu_reserved_cores)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    return data


if __name__ == "__main__":
    main()
