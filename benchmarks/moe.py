"""Qwen3-MoE with LoRA: 8 adapters against the base, and against HF transformers + PEFT, in one run.

    .venv/bin/python -m benchmarks.moe [--dtype bfloat16] [--sizes '{"rounds": 3}']
    .venv/bin/python -m benchmarks.moe --shape '{"hidden_size": 1024, ...}' --no-peft   (another shape, ours only)
    .venv/bin/python -m benchmarks.moe --kernel-ab   (ours only: the grouped expert GEMM, workers/models/cpu_moe.py,
                                                      against one oneDNN GEMM per expert; results/moe_grouped_*)
    .venv/bin/python -m benchmarks.moe --fused-ab    (ours only: the fused routing and expert block,
                                                      workers/models/moe_fused.py, on / off; results/moe_fused_ab_*)

The checkpoint has Qwen3-30B-A3B's shape scaled down to fit here: top-8 routing over its 128 experts,
its expert-to-hidden ratio (768 / 2048 = 0.375: hidden 1024, expert intermediate 384), its attention
ratios (q heads x head_dim = 2 x hidden, 8 q heads per kv head), every layer sparse, 3 layers (hidden
halved rather than quartered: at rank 16 a scaled shape inflates LoRA's share of the bytes by 2048 / H,
results/moe.md). Adapters: rank 16 on q/k/v/o and on every expert's gate/up/down (PEFT 0.21
target_parameters, made by PEFT itself so that PEFT loads them back). Workloads (greedy, ignore_eos, one wave of `batch`
requests, equal prompt lengths): base only, and 8 adapters uniformly mixed. Rounds alternate the runs
(order rotated), each timed run right after an untimed one of the same system and workload (a run is ~4 %
faster after itself: results/moe_fused_lora.md), and every ratio is taken within one round; medians over rounds are
reported, per wall second and (ours) per CPU second of the process: with one thread on a machine shared with other jobs,
the latter is what the work costs. --kernel-ab runs two of our engines instead, `before` built with the grouped
expert GEMM off (LORASERVE_MOE_KERNEL=0's path: prepacked oneDNN weights, one GEMM per active expert) and `after`
with it, alternating in the same rounds; --fused-ab the same with LORASERVE_MOE_FUSED's switch (moe_fused.ENABLED)
off for `before`, on for `after`.
"""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.checkpoint import DTYPES, _publish, _write_tokenizer, cache_root
from benchmarks.common import (FULL, Sizes, bench_main, machine_info, make_prompts, median, run_requests,
                               set_threads, sizes_dict)


@dataclass(frozen=True)
class MoeShape:
    hidden_size: int = 1024
    moe_intermediate_size: int = 384
    num_experts: int = 128
    num_experts_per_tok: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 128
    num_hidden_layers: int = 3
    vocab_size: int = 8192
    intermediate_size: int = 3072     # dense layers (none here: every layer is sparse, as in Qwen3-30B-A3B)
    max_position_embeddings: int = 4096

    @property
    def tag(self) -> str:
        return f"qwen3moe-h{self.hidden_size}-e{self.num_experts}k{self.num_experts_per_tok}-l{self.num_hidden_layers}"


SHAPE = MoeShape()
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def build_checkpoint(dtype: str, shape: MoeShape = SHAPE) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    def build(tmp: Path) -> None:
        cfg = Qwen3MoeConfig(**vars(shape), norm_topk_prob=True, rms_norm_eps=1e-6, initializer_range=0.02,
                             tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():   # transformers initialises the router to zeros: every token would pick experts 0-7
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(std=0.05)
        model.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
        _write_tokenizer(tmp, shape.vocab_size)

    return _publish(build, cache_root() / f"{shape.tag}-{dtype}")


def build_adapters(model_dir: Path, count: int, rank: int, dtype: str, shape: MoeShape = SHAPE) -> list[Path]:
    """PEFT adapters on attention and experts, B random (PEFT's zero B would add nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        def build(tmp: Path, i=i) -> None:
            base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION,
                                                    target_parameters=EXPERTS, lora_dropout=0.0))
            gen = torch.Generator().manual_seed(1000 + i)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            model.save_pretrained(tmp, safe_serialization=True)

        paths.append(_publish(build, cache_root() / f"adapters-{shape.tag}-r{rank}-{dtype}" / f"lora-{i:04d}"))
    return paths


def make_engine(model_dir: Path, dtype: str, sizes: Sizes):
    from workers import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(
        model=str(model_dir), dtype=dtype, device="cpu", seed=sizes.seed, max_num_seqs=sizes.batch,
        max_model_len=sizes.prompt_len + sizes.max_tokens + 16, max_loras_per_batch=8, max_loaded_loras=8,
        max_lora_rank=sizes.rank, kv_cache_memory_gb=0.5, cpu_threads=sizes.threads,
        max_num_batched_tokens=max(2048, sizes.batch * sizes.prompt_len),
        lora_target_modules=(*ATTENTION, "experts.gate_proj", "experts.up_proj", "experts.down_proj")))


def load_peft(model_dir: Path, paths: list[Path], dtype: str):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
    model = PeftModel.from_pretrained(base, paths[0], adapter_name="lora-0000").eval()
    for i, path in enumerate(paths[1:], 1):
        model.load_adapter(path, adapter_name=f"lora-{i:04d}")
    model.generation_config.eos_token_id = None
    torch.set_grad_enabled(False)
    return model


def run_peft(model, prompts, adapters, max_tokens: int) -> dict:
    """PEFT's LoRA on parameters merges the delta into the weight for the forward (ParamWrapper), so it has no
    mixed-adapter batch: the requests of each adapter run as their own static batch (equal lengths, no padding)."""
    import torch

    start, produced = time.perf_counter(), 0
    for name in dict.fromkeys(adapters):
        ids = torch.tensor([p for p, a in zip(prompts, adapters) if a == name])
        with torch.inference_mode():
            if name is None:
                with model.disable_adapter():
                    out = _generate(model, ids, max_tokens)
            else:
                model.set_adapter(name)
                out = _generate(model, ids, max_tokens)
        produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall}


def _generate(model, ids, max_tokens):
    import torch

    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)


def make_engines(model_dir: Path, dtype: str, sizes: Sizes, kernel_ab: bool, fused_ab: bool = False) -> dict:
    """{"ours": engine}, or for kernel_ab {"before": grouped expert GEMM off, "after": on} (chosen when each model
    is prepacked; a model built with it off keeps oneDNN's packed per-expert weights), or for fused_ab two alike
    engines that `run` runs with the fused routing and expert block (moe_fused.ENABLED, read per call) off / on."""
    from workers.models import cpu_moe

    if not (kernel_ab or fused_ab):
        return {"ours": make_engine(model_dir, dtype, sizes)}
    engines = {}
    for name, enabled in (("before", False), ("after", True)):
        cpu_moe.ENABLED = enabled or fused_ab
        engines[name] = make_engine(model_dir, dtype, sizes)
    cpu_moe.ENABLED = True
    return engines


def run(sizes: Sizes = FULL, dtype: str = "bfloat16", rounds: int | None = None, log=print,
        shape: MoeShape = SHAPE, peft: bool = True, kernel_ab: bool = False, fused_ab: bool = False) -> dict:
    from workers.models import moe_fused

    sizes = replace(sizes, num_requests=sizes.batch, shape=shape)   # one wave of `batch` requests
    set_threads(sizes.threads)
    rounds = rounds or sizes.peer_rounds
    model_dir = build_checkpoint(dtype, shape)
    paths = build_adapters(model_dir, 8, sizes.rank, dtype, shape)
    prompts = make_prompts(sizes)
    plans = {"base": [None] * sizes.batch, "eight": [f"lora-{i % 8:04d}" for i in range(sizes.batch)]}
    engines = make_engines(model_dir, dtype, sizes, kernel_ab, fused_ab)
    ab = kernel_ab or fused_ab
    for engine in engines.values():
        for i, path in enumerate(paths):
            engine.load_adapter(f"lora-{i:04d}", str(path))
    peft = load_peft(model_dir, paths, dtype) if peft and not ab else None
    for engine in engines.values():   # warm-up of every system, untimed
        for w in plans:
            run_requests(engine, prompts, plans[w], 2)
    if peft is not None:
        run_peft(peft, prompts[:8], plans["eight"][:8], 2)

    runs = [(system, w) for system in engines for w in ("eight", "base")]
    runs += [("peft", "eight"), ("peft", "base")] if peft is not None else []
    per_round = []
    for r in range(rounds):
        results = {}
        for system, w in runs[r % len(runs):] + runs[:r % len(runs)]:
            if system in engines:
                moe_fused.ENABLED = not fused_ab or system == "after"
                # each run right after an untimed one of itself: a run is ~4 % faster after itself than after the
                # other workload (what of its weights the L3 kept), which split the rounds by their order
                run_requests(engines[system], prompts, plans[w], sizes.max_tokens)
                cpu = time.process_time()
                t = run_requests(engines[system], prompts, plans[w], sizes.max_tokens)
                results[f"{system}_{w}"] = dict(t.summary(), cpu_tok_s=t.output_tokens / (time.process_time() - cpu))
            else:
                results[f"peft_{w}"] = run_peft(peft, prompts, plans[w], sizes.max_tokens)
            log(f"  round {r + 1}/{rounds} {system:>4} {w:>5}: {results[f'{system}_{w}']['output_tok_s']:7.1f} "
                "out tok/s")
        per_round.append(results)
    for engine in engines.values():
        engine.close()
    del engines, peft
    gc.collect()

    def ratio(a, b, key="output_tok_s"):
        return median([x[a][key] / x[b][key] for x in per_round])

    moe_fused.ENABLED = True
    ours = "after" if ab else "ours"
    data = {"benchmark": "moe", "dtype": dtype, "shape": vars(shape), "sizes": sizes_dict(sizes),
            "machine": machine_info(),
            "output_tok_s": {key: median([x[key]["output_tok_s"] for x in per_round]) for key in per_round[0]},
            "eight_over_base": ratio(f"{ours}_eight", f"{ours}_base"),
            "eight_over_base_decode": ratio(f"{ours}_eight", f"{ours}_base", "decode_tok_s"),
            # per CPU second of this process (1 thread): what the work costs, whatever else the machine runs
            "eight_over_base_cpu": ratio(f"{ours}_eight", f"{ours}_base", "cpu_tok_s"),
            "rounds": per_round}
    if ab:
        for w in ("base", "eight"):
            for key, suffix in (("output_tok_s", ""), ("decode_tok_s", "_decode"), ("cpu_tok_s", "_cpu")):
                data[f"after_over_before_{w}{suffix}"] = ratio(f"after_{w}", f"before_{w}", key)
    if "peft_base" in per_round[0]:
        data.update(ours_over_peft_eight=ratio("ours_eight", "peft_eight"), ours_over_peft_base=ratio("ours_base",
                                                                                                        "peft_base"))
    return data


def main(argv=None) -> dict:
    """--shape (JSON overrides of MoeShape; the result is named after its tag), --no-peft (named *_ours) and
    --kernel-ab (named moe_grouped*), then bench_main's."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--shape", default=None)
    parser.add_argument("--no-peft", action="store_true")
    parser.add_argument("--kernel-ab", action="store_true")
    parser.add_argument("--fused-ab", action="store_true")
    args, rest = parser.parse_known_args(argv)
    shape = replace(SHAPE, **json.loads(args.shape)) if args.shape else SHAPE
    ab = args.kernel_ab or args.fused_ab
    name = ("moe_grouped" if args.kernel_ab else "moe_fused_ab" if args.fused_ab else "moe") + \
        ("" if shape == SHAPE else f"_{shape.tag}") + ("_ours" if args.no_peft and not ab else "")
    return bench_main(name, __doc__, lambda sizes, dtype: run(sizes, dtype, shape=shape, peft=not args.no_peft,
                                                              kernel_ab=args.kernel_ab, fused_ab=args.fused_ab), rest)


if __name__ == "__main__":
    main()
