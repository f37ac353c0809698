"""Engine throughput by adapter workload, its ratio to base-only, and the memory-bandwidth bound.

    .venv/bin/python -m benchmarks.throughput [--dtype bfloat16] [--sizes '{"rounds": 5}']

Workloads (same prompts, lengths and max_tokens; greedy, ignore_eos; batch = max_num_seqs):
  base             no adapter
  one              one adapter for every request
  eight            8 distinct adapters, uniform: every batch holds all 8
  power<N>         N adapters (64), power-law popularity; max_loras_per_batch=8: slot paging
  power<M>         M adapters (1000), power-law; max_loaded_loras=64: host paging from disk
  power<M>_wide    the same with max_loras_per_batch = batch (a second engine): the LoRA
                   budget no longer limits the batch, so paging and adapters per step remain
Adapter popularity follows S-LoRA's generator, floor(power(alpha) * n) with alpha 0.3.
One engine serves every workload (a second one the _wide variant); rounds interleave
them, order rotated each round, so load from other processes hits all alike; each ratio
is taken within a round and the median over rounds reported. Each paging workload starts
with the 64 most popular adapters in host memory; the slot pool holds whatever the
previous workload left.
"""
from __future__ import annotations

import argparse
import gc
import time
from dataclasses import replace

from benchmarks import bandwidth
from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import (FULL, RunTiming, Sizes, machine_info, make_engine, make_prompts, median,
                               power_law_choices, run_requests, set_threads, sizes_from_json, sizes_dict,
                               write_result)

ALL_WORKLOADS = ("base", "one", "eight", "power_some", "power_many", "power_many_wide")


def adapter_name(i: int) -> str:
    return f"lora-{i:04d}"


def workload_adapters(workload: str, sizes: Sizes) -> list[str | None]:
    n = sizes.num_requests
    if workload == "base":
        return [None] * n
    if workload == "one":
        return [adapter_name(0)] * n
    if workload == "eight":
        return [adapter_name(i % 8) for i in range(n)]
    count = sizes.num_some if workload == "power_some" else sizes.num_many
    return [adapter_name(i) for i in power_law_choices(count, n, sizes.power_alpha, sizes.seed + 1)]


def workload_label(workload: str, sizes: Sizes) -> str:
    return {"base": "base only", "one": "1 adapter, all requests", "eight": "8 adapters, uniform",
            "power_some": f"{sizes.num_some} adapters, power-law (slot paging)",
            "power_many": f"{sizes.num_many} adapters, power-law (host paging)",
            "power_many_wide": f"{sizes.num_many} adapters, power-law, max_loras_per_batch={sizes.batch}"}[workload]


def _resident_set(workload: str, sizes: Sizes) -> range:
    """Adapters made host-resident before the run (untimed): the paging runs start warm with the top 64."""
    return {"base": range(0), "one": range(1), "eight": range(8)}.get(
        workload, range(min(sizes.max_loaded_loras, sizes.num_some)))


def register_adapters(engine, paths, indices) -> float:
    """Register adapters through the public API (each is loaded and validated once, untimed).

    Only the adapters a workload can reference: registering the rest of the 1000 would cost
    setup time and change nothing measured (the host cache holds loaded adapters only).
    """
    start = time.perf_counter()
    for i in sorted(indices, reverse=True):   # the most popular (low index) end up most recently used
        engine.load_adapter(adapter_name(i), str(paths[i]))
    return time.perf_counter() - start


def bound_analysis(sizes: Sizes, dtype: str, timing: dict, bw: float, base_timing: dict) -> dict:
    """Bytes per decode step and the fraction of the bandwidth bound reached (decode steps only)."""
    mean_context = sizes.prompt_len + sizes.max_tokens / 2
    batch = timing["mean_decode_batch"]
    parts = bandwidth.step_bytes(sizes.shape, dtype, batch, mean_context, timing["mean_adapters_per_decode_step"],
                                 sizes.rank)
    base_parts = bandwidth.step_bytes(sizes.shape, dtype, batch, mean_context, 0, sizes.rank)
    bound = bandwidth.bound_tok_s(parts, batch, bw)
    return {"bytes_per_step": parts, "bound_tok_s": bound,
            "fraction_of_bound": timing["decode_tok_s"] / bound if bound else float("nan"),
            "byte_bound_retention": sum(base_parts.values()) / sum(parts.values()),
            "decode_retention": timing["decode_tok_s"] / base_timing["decode_tok_s"]}


def run(sizes: Sizes = FULL, dtype: str = "bfloat16", workloads=ALL_WORKLOADS, rounds: int | None = None,
        log=print) -> dict:
    set_threads(sizes.threads)
    rounds = rounds or sizes.rounds
    model = build_checkpoint(dtype, sizes.shape)
    needed = max([sizes.num_many if any(w.startswith("power_many") for w in workloads) else 0,
                  sizes.num_some if "power_some" in workloads else 0, 8])
    paths = build_adapters(needed, sizes.shape, sizes.rank)
    prompts = make_prompts(sizes)
    plans = {w: workload_adapters(w.removesuffix("_wide"), sizes) for w in workloads}
    # power_many_wide: the same requests with max_loras_per_batch = batch, so the LoRA budget
    # never limits the batch and what remains is the cost of paging and of more adapters per step.
    engines = {"narrow": make_engine(model, dtype, sizes)}
    if "power_many_wide" in workloads:
        engines["wide"] = make_engine(model, dtype, replace(sizes, max_loras_per_batch=sizes.batch))
    referenced = {int(name.split("-")[1]) for plan in plans.values() for name in plan if name}
    referenced |= set(range(min(sizes.max_loaded_loras, sizes.num_some, needed)))
    register_s = sum(register_adapters(e, paths, referenced) for e in engines.values())
    log(f"[throughput {dtype}] {len(referenced)} of {len(paths)} adapters registered in {register_s:.1f} s; "
        "warming up")
    for engine in engines.values():   # first-call costs (allocator, oneDNN primitives) stay out of the timings
        for w in ("base", "eight"):
            run_requests(engine, prompts[:sizes.batch], workload_adapters(w, sizes)[:sizes.batch], 2)

    per_round, bandwidths = [], []
    for r in range(rounds):
        bandwidths.append(bandwidth.read_bandwidth(sizes.bandwidth_bytes, repeats=3)["samples_bytes_per_s"])
        order = list(workloads[r % len(workloads):]) + list(workloads[:r % len(workloads)])
        results = {}
        for w in order:
            engine = engines["wide" if w.endswith("_wide") else "narrow"]
            for i in _resident_set(w.removesuffix("_wide"), sizes):
                engine.load_adapter(adapter_name(i), str(paths[i]))
            before = engine.stats().get("lora", {})
            timing: RunTiming = run_requests(engine, prompts, plans[w], sizes.max_tokens)
            results[w] = timing.summary() | {"lora_stats_delta": _lora_delta(before, engine.stats().get("lora", {}))}
            log(f"  round {r + 1}/{rounds} {w:>15}: {timing.output_tok_s:7.1f} out tok/s, "
                f"decode {timing.decode_tok_s:7.1f} tok/s (batch {timing.summary()['mean_decode_batch']:4.1f}), "
                f"prefill {timing.prefill_s:.2f} s, idle {timing.idle_s:.2f} s")
        per_round.append(results)
    for engine in engines.values():
        engine.close()
    engines.clear()
    gc.collect()
    return summarize(sizes, dtype, workloads, per_round, bandwidths, register_s)


def _lora_delta(before: dict, after: dict) -> dict:
    out = {}
    for part in ("host_cache", "slots"):
        b, a = before.get(part, {}), after.get(part, {})
        for key in ("hits", "misses", "loads", "evictions"):
            if key in a:
                out[f"{part}_{key}"] = a[key] - b.get(key, 0)
    return out


def summarize(sizes: Sizes, dtype: str, workloads, per_round: list[dict], bandwidths: list[list[float]],
              register_s: float) -> dict:
    # The bound uses each round's median read bandwidth (one outlier sample must not move it),
    # and each round's base run: every figure is paired within its round, then medians are taken.
    round_bw = [median(samples) for samples in bandwidths]
    table = {}
    for w in workloads:
        runs = [r[w] for r in per_round]
        row = {"label": workload_label(w, sizes),
               "output_tok_s": median([x["output_tok_s"] for x in runs]),
               "decode_tok_s": median([x["decode_tok_s"] for x in runs]),
               "idle_s": median([x["idle_s"] for x in runs]),
               "mean_decode_batch": median([x["mean_decode_batch"] for x in runs]),
               "mean_adapters_per_decode_step": median([x["mean_adapters_per_decode_step"] for x in runs]),
               "decode_step_ms": median([x["decode_s"] / x["decode_steps"] * 1e3 for x in runs])}
        if "base" in workloads:
            ratios = [r[w]["output_tok_s"] / r["base"]["output_tok_s"] for r in per_round]
            bounds = [bound_analysis(sizes, dtype, r[w], bw, r["base"]) for r, bw in zip(per_round, round_bw)]
            row |= {"ratio_to_base": median(ratios), "ratios_per_round": ratios,
                    "decode_ratio_to_base": median([r[w]["decode_tok_s"] / r["base"]["decode_tok_s"]
                                                    for r in per_round]),
                    "bound": {"bytes_per_step": bounds[0]["bytes_per_step"]} |
                             {k: median([b[k] for b in bounds]) for k in bounds[0] if k != "bytes_per_step"}}
        table[w] = row
    for w in ("power_many", "power_many_wide"):
        if w in table and "eight" in table:
            ratios = [r[w]["output_tok_s"] / r["eight"]["output_tok_s"] for r in per_round]
            table[w] |= {"ratio_to_eight": median(ratios), "ratios_to_eight_per_round": ratios}
    return {"benchmark": "throughput", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "read_bandwidth_bytes_per_s": median(round_bw), "read_bandwidth_samples": bandwidths,
            "adapter_registration_s": register_s, "workloads": table, "rounds": per_round}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    parser.add_argument("--sizes", default=None, help="JSON overrides of benchmarks.common.Sizes")
    args = parser.parse_args(argv)
    sizes = sizes_from_json(args.sizes)
    data = run(sizes, args.dtype, tuple(args.workloads.split(",")))
    print(write_result(f"throughput_{args.dtype}", data))
    return data


if __name__ == "__main__":
    main()
