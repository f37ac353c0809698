"""The engine-level benchmark set (what `make bench` runs): results JSON, RESULTS.md, plots.

    .venv/bin/python -m benchmarks.run_all [--threads N] [--skip peer,fp32] [--note TEXT]

About 7 minutes on 2 idle CPU cores once the checkpoint and adapters are cached
(.cache/bench/, ~7 GB; generating them the first time adds about a minute). Other
load on the machine slows everything and, with more threads than free cores,
OpenMP makes it much worse: measure on a quiet machine, or pass --threads 1.
The HTTP serving benchmark (Ray + Serve, ~1 minute) runs with --with-serving, or alone:
`python -m benchmarks.serving`. vLLM's CPU build, side by side in its own venv, runs with --with-vllm
(benchmarks.peer_vllm: offline bf16 and fp32 and the HTTP serving load, ~30 minutes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks import bandwidth, hotload, peer, peer_vllm, profile_decode, report, scheduling, serving, throughput
from benchmarks.checkpoint import TINY, build_adapters, build_checkpoint
from benchmarks.common import FULL, RESULTS, Sizes, sizes_from_json, write_result

STEPS = ("checkpoint", "throughput", "fp32", "peer", "bandwidth", "profile", "hotload", "scheduling", "serving",
         "vllm")


def run_all(sizes: Sizes = FULL, results: Path = RESULTS, out: Path | None = None, skip=("serving", "vllm"),
            note: str = "", plots: bool = True, log=print) -> dict:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results.mkdir(parents=True, exist_ok=True)
    timings, written = {}, {}

    def step(name, fn):
        if name in skip:
            return
        start = time.perf_counter()
        data = fn()
        timings[name] = time.perf_counter() - start
        if data is not None:
            written[name] = write_result(data["benchmark"] + f"_{data['dtype']}", data, results)
        log(f"== {name}: {timings[name]:.0f} s")

    step("checkpoint", lambda: _prepare(sizes))
    step("throughput", lambda: throughput.run(sizes, "bfloat16", log=log))
    step("fp32", lambda: throughput.run(replace(sizes, num_requests=sizes.batch), "float32",
                                        workloads=("base", "one", "eight"), rounds=sizes.fp32_rounds, log=log))
    step("peer", lambda: peer.run(sizes, "bfloat16", log=log))
    step("bandwidth", lambda: bandwidth.run(sizes, "bfloat16", log=log))
    step("profile", lambda: profile_decode.run(sizes, "bfloat16", log=log))
    step("hotload", lambda: hotload.run(sizes, "bfloat16", log=log))
    sched = scheduling.TINY_SCHED if sizes.shape == TINY else scheduling.FULL
    step("scheduling", lambda: scheduling.run(replace(sched, threads=sizes.threads), "bfloat16", log=log))
    step("serving", lambda: serving.run(sizes, log=log))    # Ray + Serve + HTTP: skipped unless asked
    step("vllm", lambda: peer_vllm.run(sizes, log=log))      # vLLM's CPU build, its own venv: skipped unless asked
    write_result("run_all", {"benchmark": "run_all", "seconds": timings, "total_s": sum(timings.values()),
                             "note": note}, results)
    out = out or results.parent / "RESULTS.md"
    readme = results.parent.parent / "README.md" if results == RESULTS else None   # only the recorded run
    report.write_report(results, out, note, plots=plots, readme=readme)
    log(f"== total {sum(timings.values()):.0f} s; wrote {out}")
    return {"seconds": timings, "files": written, "report": out}


def _prepare(sizes: Sizes) -> None:
    for dtype in ("bfloat16", "float32"):
        build_checkpoint(dtype, sizes.shape)
    build_adapters(max(sizes.num_many, sizes.num_some, sizes.hotload_samples), sizes.shape, sizes.rank)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all CPUs)")
    parser.add_argument("--sizes", default=None, help="JSON overrides of benchmarks.common.Sizes")
    parser.add_argument("--skip", default="", help=f"comma-separated steps to skip, of {','.join(STEPS)}")
    parser.add_argument("--with-serving", action="store_true", help="also run the HTTP serving benchmark (~1 min)")
    parser.add_argument("--with-vllm", action="store_true",
                        help="also run vLLM's CPU build side by side (benchmarks.peer_vllm; ~30 min, its venv ~3.5 GB)")
    parser.add_argument("--note", default="", help="a line for the top of RESULTS.md (e.g. measured under load)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sizes = sizes_from_json(args.sizes)
    if args.threads:
        sizes = replace(sizes, threads=args.threads)
    skip = set(filter(None, args.skip.split(","))) | (set() if args.with_serving else {"serving"}) | \
        (set() if args.with_vllm else {"vllm"})
    run_all(sizes, args.results, skip=skip, note=args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
