"""Captured decode's step time follows the batch's context, not max_model_len (CPU capture emulation).

    .venv/bin/python -m benchmarks.captured_decode [--rounds N] [--lengths 2048,32768] [--full-width 2048,4096]

Decode "captured" as on a device (EngineConfig.emulate_capture: an op tape recorded under a dispatch mode and
replayed on the static buffers, workers/tape_graph.py), on the bench checkpoint, batch 16 with 100-token
prompts and eight adapters: the decode step time at each max_model_len, the engines alternating in every round.
Each step replays the narrowest (batch, block-table width) graph covering its widest sequence, so the ratio of
the step times at 32768 and 2048 should be ~1 (the acceptance: within 1.3x). `--full-width` also runs the old
behaviour (a single graph per batch bucket at max_model_len's full width) at those lengths: a tape keeps every
tensor it allocated, so the full width at 32k (~16 GB of gathered KV) is not run. Tokens are checked identical
to the same decode run eagerly (graph_safe_decode=True: the same ops, not replayed; trimmed to the widest
sequence, so one reference serves every max_model_len).
About 10 minutes on one busy core (--threads 1) once the checkpoint is cached. Writes results/captured_decode_<dtype>.json.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import replace

from benchmarks.checkpoint import ALL7, build_adapters, build_checkpoint
from benchmarks.common import (FULL, Sizes, machine_info, make_prompts, median, run_requests, set_threads,
                               sizes_dict, write_result)
from benchmarks.throughput import adapter_name

SIZES = replace(FULL, batch=16, num_requests=16, prompt_len=100, max_tokens=16, rounds=2)
TARGET = 1.3          # step time at the longest max_model_len / at the shortest


def make_engine(path, dtype: str, sizes: Sizes, max_model_len: int, num_kv_blocks: int, **kw):
    from workers import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(
        model=str(path), dtype=dtype, device="cpu", seed=sizes.seed, max_num_seqs=sizes.batch,
        max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=2048,
        max_loras_per_batch=sizes.max_loras_per_batch, max_loaded_loras=sizes.max_loaded_loras,
        max_lora_rank=sizes.rank, cpu_threads=sizes.threads, lora_target_modules=ALL7, **kw))


def generate(engine, prompts, adapters, max_tokens):
    from workers import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=False)
    return [o.token_ids for o in engine.generate(prompts, params, adapters=adapters)]


def run(sizes: Sizes = SIZES, dtype: str = "bfloat16", lengths=(2048, 32768), full_width=(2048,),
        log=print) -> dict:
    from workers.kv_cache import blocks_needed

    set_threads(sizes.threads)
    path = build_checkpoint(dtype, sizes.shape)
    sources = build_adapters(8, sizes.shape, sizes.rank)
    prompts = make_prompts(sizes)[:sizes.batch]
    adapters = [adapter_name(i % 8) for i in range(sizes.batch)]
    # each engine's KV pool: one sequence of its max_model_len (the engine's start-up check) plus the batch's
    # blocks; the pool's size does not change a decode step (it gathers by block id)
    kv_blocks = lambda n: blocks_needed(n, 16) + 1 + sizes.batch * blocks_needed(  # noqa: E731
        sizes.prompt_len + sizes.max_tokens, 16)
    variants = {f"captured_{n}": n for n in lengths}
    variants.update({f"full_width_{n}": n for n in full_width})
    # the eager reference: the same graph-safe ops run eagerly, trimmed to the batch's widest sequence, so its
    # tokens do not depend on max_model_len: one engine serves every variant
    eager = make_engine(path, dtype, sizes, min(lengths), kv_blocks(min(lengths)), graph_safe_decode=True)
    for i, source in enumerate(sources[:8]):
        eager.load_adapter(adapter_name(i), str(source))
    reference = generate(eager, prompts, adapters, sizes.max_tokens)
    eager.close()
    engines, tokens_identical, widths = {}, {}, {}
    for name, n in variants.items():
        engine = make_engine(path, dtype, sizes, n, kv_blocks(n), emulate_capture=True)
        for i, source in enumerate(sources[:8]):
            engine.load_adapter(adapter_name(i), str(source))
        graphs = engine.executor.graph_runner
        if name.startswith("full_width"):
            graphs.widths = (graphs.width,)     # the old behaviour: one graph per batch bucket, full width
        start = time.perf_counter()
        out = generate(engine, prompts, adapters, sizes.max_tokens)   # also captures the widths used (lazily)
        tokens_identical[name] = out == reference
        widths[name] = sorted({w for (_, w, _) in graphs.graphs})
        log(f"[captured_decode] {name}: widths captured {widths[name]} (of {len(graphs.widths)}), "
            f"tokens identical to eager: {tokens_identical[name]} ({time.perf_counter() - start:.1f} s)")
        engines[name] = engine
    per_round = {name: [] for name in engines}
    for r in range(sizes.rounds):            # alternating: every engine once per round
        for name, engine in engines.items():
            timing = run_requests(engine, prompts, adapters, sizes.max_tokens)
            per_round[name].append(timing.decode_s / timing.decode_steps * 1e3)
        log(f"[captured_decode] round {r}: " + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in per_round.items()))
    for engine in engines.values():
        engine.close()
    step_ms = {name: median(v) for name, v in per_round.items()}
    short, long = f"captured_{min(lengths)}", f"captured_{max(lengths)}"
    ratios = [a / b for a, b in zip(per_round[long], per_round[short])]
    ratio = median(ratios)
    log(f"[captured_decode] step time {long} / {short}: {ratio:.2f} (target <= {TARGET})")
    return {"benchmark": "captured_decode", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "lengths": list(lengths), "full_width": list(full_width), "decode_step_ms": step_ms,
            "decode_step_ms_per_round": per_round, "ratio_long_to_short": ratio, "ratios_per_round": ratios,
            "target": TARGET, "met": ratio <= TARGET, "tokens_identical_to_eager": tokens_identical,
            "widths_captured": widths}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=SIZES.rounds)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--lengths", default="2048,32768", help="max_model_len of the captured engines")
    parser.add_argument("--full-width", default="2048",
                        help="max_model_len of the old behaviour (one full-width graph per batch bucket); '' for none")
    args = parser.parse_args(argv)
    sizes = replace(SIZES, rounds=args.rounds, **({"threads": args.threads} if args.threads else {}))
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    data = run(sizes, args.dtype, ints(args.lengths), ints(args.full_width))
    print(write_result(f"captured_decode_{args.dtype}", data))
    return data


if __name__ == "__main__":
    main()
