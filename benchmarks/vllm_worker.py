"""Runs inside vLLM's own venv (.cache/vllm-venv), never in the project's: one offline throughput job.

    .cache/vllm-venv/bin/python benchmarks/vllm_worker.py SPEC.json OUT.json

Imports vLLM and nothing of this project. SPEC (written by benchmarks/peer_vllm.py): model, dtype,
adapters {name: dir}, workloads {name: [[prompt ids, adapter name or null], ...]}, max_tokens, batch,
max_model_len, max_loras, rank, enable_lora. OUT: per workload wall_s, output tokens, tok/s and the
greedy token ids (for the agreement check).
"""
import json
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = dict(enable_lora=True, max_loras=spec["max_loras"], max_lora_rank=spec["rank"],
                max_cpu_loras=max(spec["max_loras"], len(spec["adapters"]))) if spec["enable_lora"] else {}
    moe_3d = spec.get("moe_3d_lora", False)   # PEFT target_parameters on fused experts (benchmarks/moe_vllm.py)
    if moe_3d:
        lora["enable_mixed_moe_lora_format"] = True
    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=spec["batch"],
              max_model_len=spec["max_model_len"], seed=0, **lora)
    load_s = time.perf_counter() - started
    ids = {name: i + 1 for i, name in enumerate(spec["adapters"])}
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)

    def generate(requests):
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        extra = {"is_3d_lora_weight": True} if moe_3d else {}
        loras = [LoRARequest(a, ids[a], spec["adapters"][a], **extra) if a else None for _, a in requests]
        return llm.generate(prompts, params, lora_request=loras if spec["enable_lora"] else None, use_tqdm=False)

    for requests in spec["workloads"].values():            # warm-up: every adapter loaded, first-call costs paid
        generate(requests[:spec["batch"]])
    results = {}
    for name, requests in spec["workloads"].items():
        start = time.perf_counter()
        outs = generate(requests)
        wall = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        produced = sum(len(t) for t in tokens)
        results[name] = {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall,
                         "token_ids": tokens}
    open(out_path, "w").write(json.dumps({"load_s": load_s, "workloads": results}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
