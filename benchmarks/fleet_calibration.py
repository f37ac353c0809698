"""What one replica's step costs, measured on this engine, for the fleet simulation (benchmarks/fleet_sim.py).

    .venv/bin/python -m benchmarks.fleet_calibration [--repeats 9]

On the demo model (deployments/demo_model.py) with the fleet benchmark's settings (FleetSpec: max_num_seqs,
max_loaded_loras, rank-`adapter_rank` adapters on all seven projections; the engine's default LoRA budget and
CPU token budget), one thread, workers.LLMEngine stepped directly:
- decode steps at batch 1..16 with 1..4 distinct adapters (the fastest of `repeats` steps each: the cost of the
  step alone; what other processes take of the cores is the simulation's CPU-share model, not part of it);
- prefill steps of one 8..128-token prompt;
- an adapter's read from disk (files read and validated on the engine's load threads), and the step that copies
  a host-resident adapter into a device slot against the same step with it resident.
Fitted to step_s = base_s + per_seq_s * batch + per_adapter_s * distinct + per_prefill_token_s * prompt tokens
(least squares), written to results/fleet_calibration.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.fleet_replica import StepCosts
from benchmarks.fleet_workload import FLEET

BATCHES = (1, 2, 4, 8, 12, 16)
DISTINCT = (1, 2, 4)
PROMPTS = (8, 32, 64, 96, 128)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_engine(model: Path, adapters: list[Path]):
    from workers import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", seed=0, cpu_threads=1,
                                    max_num_seqs=FLEET.max_num_seqs, max_loaded_loras=FLEET.max_loaded_loras,
                                    max_lora_rank=FLEET.adapter_rank, max_model_len=512, lora_target_modules=TARGETS))
    for i, path in enumerate(adapters):
        engine.load_adapter(f"cal-{i}", str(path))
    return engine


def timed_step(engine) -> tuple[float, tuple[int, int]]:
    start = time.perf_counter()
    engine.step_deltas()
    return time.perf_counter() - start, engine.last_step


def decode_points(engine, repeats: int) -> list[tuple[int, int, float]]:
    """(batch, distinct adapters, fastest decode step seconds)."""
    from workers import SamplingParams

    params = SamplingParams(max_tokens=repeats + 8, temperature=0.0, ignore_eos=True, logprobs=False)
    points = []
    for batch in BATCHES:
        for distinct in (d for d in DISTINCT if d <= batch):
            ids = [engine.add_request([5 + i] * 8, params, f"cal-{i % distinct}", detokenize=False)
                   for i in range(batch)]
            for _ in range(8):   # prefill first: until a step decodes the whole batch
                if timed_step(engine)[1] == (batch, 0):
                    break
            times = [t for t, (decodes, prefill) in (timed_step(engine) for _ in range(repeats))
                     if decodes == batch and prefill == 0]
            points.append((batch, distinct, min(times)))
            for rid in ids:
                engine.abort(rid)
            engine.step_deltas()
    return points


def prefill_points(engine, repeats: int) -> list[tuple[int, float]]:
    """(prompt tokens, fastest step that prefills it, one adapter, nothing else running)."""
    from workers import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=False)
    points = []
    for prompt in PROMPTS:
        times = []
        for r in range(repeats):
            engine.add_request([7 + r] + [3 + (j * 7 + r) % 400 for j in range(prompt - 1)], params, "cal-0",
                               detokenize=False)
            t, _ = timed_step(engine)
            times.append(t)
            while engine.has_unfinished():
                engine.step_deltas()
        points.append((prompt, min(times)))
    return points


def slot_load_s(engine, adapters: list[Path], repeats: int) -> float:
    """A one-token decode batch's step with one adapter that must be copied into a slot, minus the same with the
    adapter already in its slot (one request each)."""
    from workers import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=False)
    cold, warm = [], []
    for r in range(repeats):
        for adapter, out in ((f"cal-{4 + r % 4}", cold), (f"cal-{4 + r % 4}", warm)):
            engine.add_request([9, 10, 11, 12], params, adapter, detokenize=False)
            t, _ = timed_step(engine)
            out.append(t)
            while engine.has_unfinished():
                engine.step_deltas()
        for i in range(4):   # push r's adapter out of the slots: the next round's first step loads it again
            engine.add_request([9, 10, 11, 12], params, f"cal-{i}", detokenize=False)
        while engine.has_unfinished():
            engine.step_deltas()
    return max(0.0, min(cold) - min(warm))


def disk_load_s(engine, adapters: list[Path]) -> float:
    times = []
    for i, path in enumerate(adapters):
        start = time.perf_counter()
        engine.adapters.read(f"disk-{i}", str(path)).result()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fit(decode: list[tuple[int, int, float]], prefill: list[tuple[int, float]]) -> dict:
    a = np.array([[1.0, b, d] for b, d, _ in decode])
    base, per_seq, per_adapter = np.linalg.lstsq(a, np.array([t for _, _, t in decode]), rcond=None)[0]
    # a prefill step of one prompt: base + one sequence + one adapter + per-token cost
    tokens = np.array([[1.0, p] for p, _ in prefill])
    offset, per_token = np.linalg.lstsq(tokens, np.array([t for _, t in prefill]), rcond=None)[0]
    return {"base_s": float(base), "per_seq_s": float(per_seq), "per_adapter_s": float(per_adapter),
            "per_prefill_token_s": float(per_token), "prefill_offset_s": float(offset)}


def calibrated_costs(path: Path = RESULTS / "fleet_calibration.json") -> StepCosts:
    """The fit of a recorded calibration as the simulation's step costs (a negative slope read as none)."""
    data = json.loads(path.read_text())
    fit = data["fit"]
    return StepCosts(base_s=fit["base_s"], per_seq_s=max(0.0, fit["per_seq_s"]),
                     per_adapter_s=max(0.0, fit["per_adapter_s"]), per_prefill_token_s=fit["per_prefill_token_s"],
                     slot_load_s=data["slot_load_s"], disk_load_s=data["disk_load_s"])


def main(argv=None) -> dict:
    from deployments.demo_model import ensure_demo, write_adapter
    from transformers import AutoConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    model, _ = ensure_demo()
    hf_config = AutoConfig.from_pretrained(model)
    with tempfile.TemporaryDirectory(prefix="fleetcal-") as tmp:
        adapters = [Path(tmp) / f"a{i}" for i in range(12)]
        for i, path in enumerate(adapters):
            write_adapter(path, hf_config, FLEET.adapter_rank, 2 * FLEET.adapter_rank, TARGETS, seed=100 + i)
        engine = make_engine(model, adapters[:8])
        disk = disk_load_s(engine, adapters)
        engine.step_deltas()
        decode = decode_points(engine, args.repeats)
        prefill = prefill_points(engine, args.repeats)
        slot = slot_load_s(engine, adapters, args.repeats)
        config = engine.config
        engine.close()
    result = {"what": "one replica of the demo model (CPU, 1 thread), workers.LLMEngine stepped directly",
              "engine": {"max_num_seqs": config.max_num_seqs, "max_loras_per_batch": config.max_loras_per_batch,
                         "max_loaded_loras": config.max_loaded_loras,
                         "max_num_batched_tokens": engine.controller.max_num_batched_tokens,
                         "adapter_rank": FLEET.adapter_rank, "lora_target_modules": list(TARGETS)},
              "decode_points": [{"batch": b, "distinct_adapters": d, "step_s": t} for b, d, t in decode],
              "prefill_points": [{"prompt_tokens": p, "step_s": t} for p, t in prefill],
              "disk_load_s": disk, "slot_load_s": slot, "fit": fit(decode, prefill), "machine": machine_info()}
    print(write_result("fleet_calibration", result))
    return result


if __name__ == "__main__":
    main()
