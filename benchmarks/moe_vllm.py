"""vLLM's CPU build beside ours on benchmarks/moe.py's checkpoint: base only, and whether it serves MoE LoRA.

    .venv/bin/python -m benchmarks.moe_vllm [pairs]      (vLLM from .cache/vllm-venv, as benchmarks.peer_vllm)

Each system runs the same 16 x 32-token prompts -> 16 (greedy, ignore_eos) in a process of its own
(benchmarks.peer_vllm.run_job), alternating, the ratio taken within each pair. Then one vLLM job with the
8 expert adapters (PEFT target_parameters; enable_mixed_moe_lora_format and is_3d_lora_weight, which
vLLM asks for 3-D expert LoRA) records whether its CPU build runs MoE LoRA, and its error if not.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks import moe, peer_vllm
from benchmarks.common import RESULTS, make_prompts, median, sizes_from_json

SIZES = '{"batch": 16, "max_tokens": 16, "prompt_len": 32, "threads": 1}'


def spec_for(model: Path, prompts, sizes, adapters: dict[str, str]) -> dict:
    names = list(adapters)
    return {"model": str(model), "dtype": "bfloat16", "adapters": adapters,
            "workloads": {"eight" if names else "base": [[p, names[i % len(names)] if names else None]
                                                           for i, p in enumerate(prompts)]},
            "max_tokens": sizes.max_tokens, "batch": sizes.batch,
            "max_model_len": sizes.prompt_len + sizes.max_tokens + 16, "max_loras": 8, "rank": sizes.rank,
            "enable_lora": bool(names), "threads": sizes.threads}


def main(pairs: int = 3) -> dict:
    sizes = replace(sizes_from_json(SIZES), shape=moe.SHAPE, num_requests=16)
    model = moe.build_checkpoint("bfloat16")
    prompts = make_prompts(sizes)
    spec = spec_for(model, prompts, sizes, {})
    runs = []
    for r in range(pairs):
        jobs = {s: peer_vllm.run_job(s, spec) for s in (("vllm", "ours") if r % 2 == 0 else ("ours", "vllm"))}
        same, total = peer_vllm.agreement(jobs["ours"], jobs["vllm"])
        tok_s = {s: j["workloads"]["base"]["output_tok_s"] for s, j in jobs.items()}
        runs.append({"tok_s": tok_s, "ours_over_vllm": tok_s["ours"] / tok_s["vllm"], "agree": [same, total]})
        print(runs[-1], flush=True)
    paths = moe.build_adapters(model, 8, sizes.rank, "bfloat16")
    lora_spec = spec_for(model, prompts, sizes, {f"lora-{i:04d}": str(p) for i, p in enumerate(paths)})
    lora_spec["moe_3d_lora"] = True   # read by vllm_worker.py
    try:
        lora = {"ok": True, "tok_s": peer_vllm.run_job("vllm", lora_spec)["workloads"]["eight"]["output_tok_s"]}
    except RuntimeError as error:
        lora = {"ok": False, "error": str(error)[-600:]}
    out = {"benchmark": "moe_vllm", "pairs": runs, "ours_over_vllm_base": median([p["ours_over_vllm"] for p in runs]),
           "vllm_moe_lora": lora}
    (RESULTS / "moe_vllm_bfloat16.json").write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
