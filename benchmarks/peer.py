"""The peer: Hugging Face transformers + PEFT on the same checkpoint, adapters and requests.

    .venv/bin/python -m benchmarks.peer          (about a minute on 2 CPU cores)

PEFT serves a mixed-adapter batch with `generate(adapter_names=[...])` over one static
batch of `batch` requests; our engine gets the same requests (prompts, lengths,
max_tokens, greedy, no early stop) with max_num_seqs = batch. Two workloads: the
8-adapter uniform mix and base only. Rounds alternate the four runs (order rotated)
and every ratio is taken within one round; medians over rounds are reported.
"""
from __future__ import annotations

import gc
import time
from dataclasses import replace

from benchmarks.checkpoint import DTYPES, build_adapters, build_checkpoint
from benchmarks.common import (FULL, Sizes, bench_main, machine_info, make_engine, make_prompts, median,
                               run_requests, set_threads, sizes_dict)
from benchmarks.throughput import adapter_name, workload_adapters

PEFT_BASE = "__base__"   # PEFT's name for "no adapter" in adapter_names


def load_peft(model_dir, adapter_dirs: dict, dtype: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.generation_config.eos_token_id = None   # ignore_eos, like the engine runs
    torch.set_grad_enabled(False)
    return model


def run_peft(model, prompts, adapters, batch: int, max_tokens: int) -> dict:
    """Static batches of `batch` (equal prompt lengths: no padding); output tokens/s over the whole set."""
    import torch

    start = time.perf_counter()
    produced = 0
    for i in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[i:i + batch])
        names = [a or PEFT_BASE for a in adapters[i:i + batch]]
        kwargs = {} if all(n == PEFT_BASE for n in names) else {"adapter_names": names}
        with torch.inference_mode():
            if not kwargs:
                with model.disable_adapter():
                    out = _generate(model, ids, max_tokens, kwargs)
            else:
                out = _generate(model, ids, max_tokens, kwargs)
        produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall}


def _generate(model, ids, max_tokens, kwargs):
    import torch

    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kwargs)


def run(sizes: Sizes = FULL, dtype: str = "bfloat16", rounds: int | None = None, log=print) -> dict:
    sizes = replace(sizes, num_requests=sizes.batch)   # one static batch for PEFT, one wave for us
    set_threads(sizes.threads)
    rounds = rounds or sizes.peer_rounds
    model_dir = build_checkpoint(dtype, sizes.shape)
    paths = build_adapters(8, sizes.shape, sizes.rank)
    prompts = make_prompts(sizes)
    engine = make_engine(model_dir, dtype, sizes)
    for i, path in enumerate(paths):
        engine.load_adapter(adapter_name(i), str(path))
    peft = load_peft(model_dir, {adapter_name(i): str(p) for i, p in enumerate(paths)}, dtype)
    plans = {w: workload_adapters(w, sizes) for w in ("eight", "base")}
    # warm-up of both systems, untimed
    run_requests(engine, prompts[:sizes.batch], plans["eight"][:sizes.batch], 2)
    run_peft(peft, prompts[:sizes.batch], plans["eight"][:sizes.batch], sizes.batch, 2)

    runs = [("ours", "eight"), ("peft", "eight"), ("ours", "base"), ("peft", "base")]
    per_round = []
    for r in range(rounds):
        results = {}
        for system, w in runs[r % len(runs):] + runs[:r % len(runs)]:
            if system == "ours":
                t = run_requests(engine, prompts, plans[w], sizes.max_tokens)
                results[f"ours_{w}"] = {"wall_s": t.wall_s, "output_tokens": t.output_tokens,
                                        "output_tok_s": t.output_tok_s}
            else:
                results[f"peft_{w}"] = run_peft(peft, prompts, plans[w], sizes.batch, sizes.max_tokens)
            tok_s = results[f"{system}_{w}"]["output_tok_s"]
            log(f"  round {r + 1}/{rounds} {system:>4} {w:>5}: {tok_s:7.1f} out tok/s")
        per_round.append(results)
    engine.close()
    del engine, peft
    gc.collect()

    def ratio(a, b):
        return median([x[a]["output_tok_s"] / x[b]["output_tok_s"] for x in per_round])

    summary = {key: median([x[key]["output_tok_s"] for x in per_round]) for key in per_round[0]}
    return {"benchmark": "peer", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "output_tok_s": summary,
            "ours_over_peft_mixed": ratio("ours_eight", "peft_eight"),
            "ours_over_peft_base": ratio("ours_base", "peft_base"),
            "peft_lora_retention": ratio("peft_eight", "peft_base"),
            "ours_lora_retention": ratio("ours_eight", "ours_base"),
            "rounds": per_round}


def main(argv=None) -> dict:
    return bench_main("peer", __doc__, run, argv)


if __name__ == "__main__":
    main()
