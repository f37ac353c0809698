"""The batch-32 base decode step, part by part: CPU element-wise kernels (workers/cpu_ops.c) off / on, CPU graphs.

    .venv/bin/python -m benchmarks.step_profile      (about three minutes)

One process, four variants alternating round by round on the same prompts (base requests only, greedy; each
round starts at the next variant, so that no variant always runs after the same one):
`torch` (the engine as the benchmarks run it, LoRA enabled, cpu_ops.ENABLED off: the torch ops), `kernels`
(the same engine, kernels on: cpu_ops.c's element-wise ops and the greedy sampler's argmax) and `kernels_lora_off` (an engine built without LoRA: what a step with no adapter
costs the LoRA-enabled engine is the difference), all three eager (GraphRunner.use_cpu_graphs off), and `graphs`
(the engine as it serves: LoRA enabled, kernels on, a step without adapters replaying its CPU graph,
workers/cpu_graph.py; its gemm, attention and elementwise parts are the kernels' own times, taken inside the
replay by cpu_program.c). Parts are wall-clock accumulators on the hot functions
(benchmarks.profile_decode.timed_parts): gemm (every base linear, LM head included; where the MLP's SiLU-and-mul runs
in its gate_up GEMV, that too), attention, lora, sampling,
and "other" = the rest of the step, split into elementwise (norms, rope + KV write, SiLU-and-mul), model_rest
(embedding, residual adds, the forward's Python and its input buffers) and host (scheduling, step bookkeeping,
detokenization: the step outside the forward and the sampler). The step-time ratios come from a plain run of
each variant in the same round (no accumulators: they add ~1 us to each of ~140 wrapped calls a step).

The process runs as an engine process does: glibc's malloc on transparent huge pages (workers/engine_process.py's
MALLOC_TUNABLES; it re-executes itself with them unless GLIBC_TUNABLES is set, e.g. empty for glibc's defaults).

Beside them, the fraction of the memory-bandwidth bound each variant reaches (benchmarks/bandwidth.py: the
bytes a step must read at this machine's median read bandwidth) and the GEMM-only ceiling: the fraction a
step made of nothing but its measured GEMMs would reach. Writes results/step_profile.json and .md
(step_profile_t<N> for another thread count than the benchmarks' default, e.g. --sizes '{"threads": 1}').
"""
from __future__ import annotations

import os
from statistics import median

from benchmarks import bandwidth
from benchmarks.checkpoint import build_checkpoint
from benchmarks.common import (FULL, RESULTS, Sizes, as_engine_process, machine_info, make_engine, make_prompts,
                               run_requests, set_threads, sizes_dict, sizes_from_json, write_result)
from benchmarks.profile_decode import run_requests_split, timed_graphs, timed_parts

TIMED = ("base_linear", "attention", "lora", "sampling", "elementwise", "forward")
# (name, LoRA enabled, cpu_ops kernels, CPU decode graphs)
VARIANTS = (("torch", True, False, False), ("kernels", True, True, False), ("kernels_lora_off", False, True, False),
            ("graphs", True, True, True))
def measure(engine, prompts, sizes: Sizes) -> dict:
    """One run of the batch to its end: ms per decode step, by part."""
    totals, prefill = dict.fromkeys(TIMED, 0.0), dict.fromkeys(TIMED, 0.0)
    with timed_parts(totals), timed_graphs(engine, totals):
        timing = run_requests_split(engine, prompts, [None] * len(prompts), sizes.max_tokens, totals, prefill)
    ms = {p: (totals[p] - prefill[p]) / timing.decode_steps * 1e3 for p in TIMED}
    step = timing.decode_s / timing.decode_steps * 1e3
    parts = {"gemm": ms["base_linear"], "attention": ms["attention"], "lora": ms["lora"], "sampling": ms["sampling"]}
    other = step - sum(parts.values())
    split = {"elementwise": ms["elementwise"],
             "model_rest": ms["forward"] - ms["base_linear"] - ms["attention"] - ms["lora"] - ms["elementwise"],
             "host": step - ms["forward"] - ms["sampling"]}
    return {"step_ms": step, "parts_ms": {**parts, "other": other}, "other_ms": split}


def run(sizes: Sizes = FULL, dtype: str = "bfloat16", rounds: int = 3, log=print) -> dict:
    from workers import cpu_ops

    set_threads(sizes.threads)
    checkpoint = build_checkpoint(dtype, sizes.shape)
    engines = {True: make_engine(checkpoint, dtype, sizes), False: make_engine(checkpoint, dtype, sizes, False)}
    prompts = make_prompts(sizes)[:sizes.batch]
    samples: dict[str, list[dict]] = {name: [] for name, *_ in VARIANTS}
    try:
        for name, lora, kernels, graphs in VARIANTS:   # warm-up: every shape of the run once, each way
            cpu_ops.ENABLED, engines[lora].executor.graph_runner.use_cpu_graphs = kernels, graphs
            run_requests(engines[lora], prompts, [None] * len(prompts), 4)
        for r in range(rounds):
            k = r % len(VARIANTS)
            for name, lora, kernels, graphs in VARIANTS[k:] + VARIANTS[:k]:
                cpu_ops.ENABLED, engines[lora].executor.graph_runner.use_cpu_graphs = kernels, graphs
                samples[name].append(measure(engines[lora], prompts, sizes))
                row = samples[name][-1]
                plain = run_requests(engines[lora], prompts, [None] * len(prompts), sizes.max_tokens)
                row["plain_step_ms"] = plain.decode_s / plain.decode_steps * 1e3
                log(f"[step_profile {dtype}] round {r} {name:>16}: {row['step_ms']:6.1f} ms/step = " +
                    ", ".join(f"{p} {v:.1f}" for p, v in row["parts_ms"].items()) + " (" +
                    ", ".join(f"{p} {v:.1f}" for p, v in row["other_ms"].items()) + f"); plain run {row['plain_step_ms']:.1f}")
    finally:
        cpu_ops.ENABLED = True
        for engine in engines.values():
            engine.close()
    bw = bandwidth.read_bandwidth(sizes.bandwidth_bytes)["median_bytes_per_s"]
    step_bytes = bandwidth.step_bytes(sizes.shape, dtype, sizes.batch, sizes.prompt_len + sizes.max_tokens / 2, 0,
                                      sizes.rank)
    bound_ms = sum(step_bytes.values()) / bw * 1e3
    variants = {}
    for name, rows in samples.items():
        med = lambda key, part: median(r[key][part] for r in rows)  # noqa: E731
        step, plain = median(r["step_ms"] for r in rows), median(r["plain_step_ms"] for r in rows)
        parts = {p: med("parts_ms", p) for p in rows[0]["parts_ms"]}
        variants[name] = {"step_ms": step, "plain_step_ms": plain, "parts_ms": parts, "other_ms": {p: med("other_ms", p) for p in
                                                                           rows[0]["other_ms"]},
                          "other_fraction": parts["other"] / step, "fraction_of_bound": bound_ms / plain,
                          "gemm_ceiling_fraction": min(1.0, bound_ms / parts["gemm"])}
    ratios = {"kernels_over_torch_step": [k["plain_step_ms"] / t["plain_step_ms"] for k, t in
                                          zip(samples["kernels"], samples["torch"])],
              "lora_off_over_lora_enabled_step": [o["plain_step_ms"] / k["plain_step_ms"] for o, k in
                                                  zip(samples["kernels_lora_off"], samples["kernels"])],
              "graphs_over_kernels_step": [g["plain_step_ms"] / k["plain_step_ms"] for g, k in
                                           zip(samples["graphs"], samples["kernels"])]}
    return {"benchmark": "step_profile", "dtype": dtype, "sizes": sizes_dict(sizes), "machine": machine_info(),
            "rounds": rounds, "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "read_bandwidth_bytes_per_s": bw, "step_bytes": step_bytes, "bound_step_ms": bound_ms,
            "variants": variants, "ratios_per_round": ratios, "samples": samples}


def markdown(data: dict) -> str:
    v = data["variants"]
    lines = [f"# Batch-{data['sizes']['batch']} base decode step ({data['dtype']}, {data['sizes']['threads']} "
             f"threads), CPU element-wise kernels off / on, CPU graphs", "",
             "`.venv/bin/python -m benchmarks.step_profile`: medians of "
             f"{data['rounds']} alternating rounds, ms per decode step (GLIBC_TUNABLES="
             f"{data.get('glibc_tunables') or ''!r}).", "",
             "| variant | step (plain run) | step | gemm | attention | lora | sampling | other | elementwise | model_rest "
             "| host | other / step | of bandwidth bound | GEMM-only ceiling |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in v.items():
        p, o = row["parts_ms"], row["other_ms"]
        lines.append(f"| {name} | {row['plain_step_ms']:.1f} | {row['step_ms']:.1f} | {p['gemm']:.1f} | {p['attention']:.1f} | {p['lora']:.2f} | "
                     f"{p['sampling']:.1f} | {p['other']:.1f} | {o['elementwise']:.1f} | {o['model_rest']:.1f} | "
                     f"{o['host']:.1f} | {row['other_fraction']:.0%} | {row['fraction_of_bound']:.2f} | "
                     f"{row['gemm_ceiling_fraction']:.2f} |")
    r = data["ratios_per_round"]
    lines += ["", "Plain-run step time ratios per round (same round, alternating): kernels / torch " +
              ", ".join(f"{x:.3f}" for x in r["kernels_over_torch_step"]) + "; LoRA off / LoRA enabled (no adapter "
              "in the batch) " + ", ".join(f"{x:.3f}" for x in r["lora_off_over_lora_enabled_step"])
              + "; graphs / kernels " + ", ".join(f"{x:.3f}" for x in r["graphs_over_kernels_step"]) + ".",
              "", f"Bandwidth bound: {sum(data['step_bytes'].values()) / 1e6:.0f} MB a step at "
              f"{data['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (median read) = {data['bound_step_ms']:.1f} ms; "
              "the GEMM-only ceiling is bound / the step's measured GEMM time.", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    import argparse

    as_engine_process("benchmarks.step_profile", argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sizes", default=None, help="JSON overrides of benchmarks.common.Sizes")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = sizes_from_json(args.sizes)
    data = run(sizes, args.dtype, args.rounds)
    name = "step_profile" if sizes.threads == FULL.threads else f"step_profile_t{sizes.threads}"
    print(write_result(name, data))
    (RESULTS / f"{name}.md").write_text(markdown(data))
    return data


if __name__ == "__main__":
    main()
