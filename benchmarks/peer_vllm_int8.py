"""vLLM's CPU build on an int8 copy of the bench checkpoint, beside ours: W8A8 / bf16 decode speed each.

    .venv/bin/python -m benchmarks.peer_vllm_int8 [--rounds 1] [--threads N]

vLLM does not read msModelSlim's layout on the CPU (its `ascend` quantization is vllm-ascend's), so
the same int8 weights and scales are written as a compressed-tensors W8A8 int8 checkpoint (channel-
wise symmetric int8 weights, dynamic per-token symmetric int8 activations: the same arithmetic),
which vLLM's CPU build serves through its oneDNN int8 scaled-mm. Each system runs its float (bf16)
and int8 checkpoints in processes of its own (benchmarks/peer_vllm.py's jobs), base model only,
batches of 1, 8 and 32 requests (32 prompt tokens -> 32, greedy); ours int8 twice: on the engine's
CPU kernel (the fused one where the CPU has AMX int8) and on the oneDNN path it replaced
(`int8_onednn`: LORASERVE_W8A8_KERNEL=onednn in that job's environment). Output tok/s, ratios
int8 / bf16 per system, ours / vLLM per dtype (within a round, medians over rounds), and greedy
agreement between the int8 engines. Rounds alternate the job order.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from benchmarks.checkpoint import _publish, build_adapters, build_checkpoint, cache_root
from benchmarks.common import FULL, machine_info, make_prompts, median, sizes_dict, write_result
from benchmarks.peer_vllm import agreement, make_spec, run_job
from benchmarks.quantized import quantized_checkpoint
from workers.quant.description import DESCRIPTION_FILE

BATCHES = (1, 8, 32)
COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True}}}}


def compressed_tensors_copy(w8a8_dir: Path) -> Path:
    """The W8A8_DYNAMIC checkpoint's int8 weights and scales as compressed-tensors (offsets dropped: all 0)."""
    from safetensors.torch import load_file, save_file

    def build(tmp: Path) -> None:
        for item in w8a8_dir.iterdir():
            if item.is_file() and item.name != DESCRIPTION_FILE and not item.name.startswith("model.safetensors"):
                if item.suffix != ".safetensors":
                    shutil.copy2(item, tmp / item.name)
        config = json.loads((w8a8_dir / "config.json").read_text())
        config["quantization_config"] = COMPRESSED_TENSORS
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        tensors = {}
        for file in sorted(w8a8_dir.glob("*.safetensors")):
            tensors.update({k: v for k, v in load_file(file).items() if not k.endswith(".weight_offset")})
        save_file(tensors, os.fspath(tmp / "model.safetensors"), metadata={"format": "pt"})

    return _publish(build, cache_root() / f"{w8a8_dir.name}-compressed_tensors")


def run(rounds: int, threads: int | None = None) -> dict:
    sizes = replace(FULL, batch=max(BATCHES), num_requests=max(BATCHES), threads=threads or FULL.threads)
    float_dir = build_checkpoint("bfloat16", sizes.shape)
    w8a8 = quantized_checkpoint(float_dir)
    models = {("vllm", "bf16"): float_dir, ("vllm", "int8"): compressed_tensors_copy(w8a8),
              ("ours", "bf16"): float_dir, ("ours", "int8"): w8a8, ("ours", "int8_onednn"): w8a8}
    paths = build_adapters(1, sizes.shape, sizes.rank)
    prompts = make_prompts(sizes)
    samples, last = {k: [] for k in models}, {}
    for r in range(rounds):
        for key in (list(models) if r % 2 == 0 else list(models)[::-1]):
            spec = make_spec(models[key], "bfloat16", sizes, paths, enable_lora=False)
            spec["adapters"] = {}
            spec["workloads"] = {f"batch {b}": [[p, None] for p in prompts[:b]] for b in BATCHES}
            if key[1] == "int8_onednn":
                os.environ["LORASERVE_W8A8_KERNEL"] = "onednn"   # inherited by our job's process only
            try:
                last[key] = run_job(key[0], spec)
            except RuntimeError as exc:   # recorded: whether and why vLLM cannot load the int8 checkpoint
                last[key] = {"error": str(exc)[-1500:]}
                continue
            finally:
                os.environ.pop("LORASERVE_W8A8_KERNEL", None)
            samples[key].append({w: j["output_tok_s"] for w, j in last[key]["workloads"].items()})
            print(key, samples[key][-1], flush=True)
    result = {"machine": machine_info(), "sizes": sizes_dict(sizes), "checkpoints": {f"{s} {d}": str(p)
                                                                                   for (s, d), p in models.items()}}
    for system in ("vllm", "ours"):
        if samples[(system, "int8")] and samples[(system, "bf16")]:
            result[system] = {f"batch {b}": {
                "bf16_tok_s": round(median([s[f"batch {b}"] for s in samples[(system, "bf16")]]), 1),
                "int8_tok_s": round(median([s[f"batch {b}"] for s in samples[(system, "int8")]]), 1),
                "int8 / bf16": round(median([i[f"batch {b}"] / f[f"batch {b}"] for i, f in
                                             zip(samples[(system, "int8")], samples[(system, "bf16")])]), 3)}
                for b in BATCHES}
        else:
            result[system] = {"error": next((v["error"] for k, v in last.items() if k[0] == system and "error" in v),
                                            "no run")}
    if samples[("ours", "int8_onednn")]:
        result["ours"]["int8_onednn_tok_s"] = {f"batch {b}": round(median([s[f"batch {b}"] for s in
                                                                           samples[("ours", "int8_onednn")]]), 1)
                                               for b in BATCHES}
    rounds_done = min(len(v) for v in samples.values())
    if rounds_done:   # ours / vLLM within each round (the same machine state), medians over rounds
        result["ours / vllm"] = {f"batch {b}": {
            f"{ours} / vllm {theirs}": round(median([o[f"batch {b}"] / v[f"batch {b}"] for o, v in
                                                     zip(samples[("ours", ours)], samples[("vllm", theirs)])]), 3)
            for ours, theirs in (("int8", "int8"), ("int8_onednn", "int8"), ("bf16", "bf16"))} for b in BATCHES}
    for ours in ("int8", "int8_onednn"):
        if "workloads" in last.get(("vllm", "int8"), {}) and "workloads" in last.get(("ours", ours), {}):
            same, total = agreement(last[("ours", ours)], last[("vllm", "int8")])
            result[f"{ours}_greedy_tokens_equal_ours_vs_vllm"] = f"{same}/{total}"
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="threads of each system (default: all CPUs)")
    args = parser.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    # one file per thread count (1 thread: the name the earlier runs kept)
    print(write_result("peer_vllm_int8" + ("" if threads == 1 else f"_t{threads}"), run(args.rounds, args.threads)))
