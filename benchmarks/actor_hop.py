"""Per-step cost of the Ray actor hop: decode step time, TP=1 in-process vs TP=1 actor vs TP=2 actors.

    .venv/bin/python -m benchmarks.actor_hop        (about a minute on 2 CPU cores)

One tiny random Qwen3 checkpoint, the same batch of greedy requests in every
mode, CPU / gloo, Ray on loopback. The three engines live side by side and the
measurement rounds interleave them, so load from other processes hits each mode
alike; the result is a ratio to in-process from this one run, written to
benchmarks/results/actor_hop.json. All torch compute runs on one thread per
process (Ray gives a 1-CPU actor one OpenMP thread; the in-process engine is set
to match), so the ratios measure the hop, not thread counts.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the tiny-checkpoint factory shared with the tests

MODES = {"tp1_inprocess": dict(), "tp1_actor": dict(distributed_executor="ray"),
         "tp2_actors": dict(tensor_parallel_size=2)}


def decode_step_seconds(engine, prompts, steps: int) -> list[float]:
    """Admit the batch (one prefill step), then time each of `steps` decode steps."""
    from workers import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    engine.step()
    assert len(engine.controller.running) == len(prompts) and not engine.controller.waiting, "not one prefill"
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def tiny_engines(modes: dict, prefix: str, num_cpus: int, before_each=lambda mode: None):
    """An LLMEngine per mode (its EngineConfig keywords) on one tiny random Qwen3 checkpoint, CPU, float32, one
    torch thread per process, on a private loopback Ray; closed, Ray stopped and the temp dir removed after."""
    import ray
    import torch

    from factories import make_model
    from workers import EngineConfig, LLMEngine
    from workers.ray_utils import init_local_ray

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))   # short: Ray's socket paths have a length limit
    engines = {}
    try:
        model = make_model(work / "model", "qwen3")
        init_local_ray(str(work / "ray"), num_cpus=num_cpus)
        for mode, kwargs in modes.items():
            before_each(mode)
            engines[mode] = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                                   max_model_len=256, enforce_eager=True, cpu_threads=1,
                                                   **kwargs))
        yield engines
    finally:
        for engine in engines.values():
            engine.close()
        ray.shutdown()   # before removing its temp dir, which its processes write to
        shutil.rmtree(work, ignore_errors=True)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "actor_hop.json"))
    args = parser.parse_args()

    import ray
    import torch

    from factories import PROMPTS

    with tiny_engines(MODES, "lshop", num_cpus=3) as engines:
        prompts = PROMPTS[:args.batch]
        for engine in engines.values():   # warm-up round, not recorded
            decode_step_seconds(engine, prompts, 4)
        samples = {mode: [] for mode in engines}
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                samples[mode] += decode_step_seconds(engine, prompts, args.steps)

    median_ms = {mode: 1e3 * statistics.median(s) for mode, s in samples.items()}
    base = median_ms["tp1_inprocess"]
    result = {
        "benchmark": "actor_hop", "model": "tiny random qwen3 (hidden 64, 2 layers, vocab 384)",
        "device": "cpu", "dist_backend": "gloo", "batch": args.batch,
        "decode_steps_per_mode": {mode: len(s) for mode, s in samples.items()},
        "median_step_ms": {mode: round(ms, 3) for mode, ms in median_ms.items()},
        "p90_step_ms": {mode: round(1e3 * statistics.quantiles(s, n=10)[-1], 3) for mode, s in samples.items()},
        "ratio_to_tp1_inprocess": {mode: round(ms / base, 2) for mode, ms in median_ms.items()},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "ray": ray.__version__},
        "recorded": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':<15} {'median ms':>10} {'p90 ms':>8} {'ratio':>6}")
    for mode in samples:
        print(f"{mode:<15} {median_ms[mode]:>10.2f} {result['p90_step_ms'][mode]:>8.2f} "
              f"{result['ratio_to_tp1_inprocess'][mode]:>6.2f}")
    print(f"written to {args.out}")
    return result


if __name__ == "__main__":
    main()
