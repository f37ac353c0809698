"""The "where the time goes" paragraphs of RESULTS.md, computed from a recorded run."""
from __future__ import annotations

from benchmarks.common import TARGETS, median


def analysis(data: dict) -> list[str]:
    """Where the time goes, in numbers from this run (every paragraph skipped when its data is absent)."""
    out = ["## Where the time goes", ""]
    prof = data.get("profile_decode_bfloat16", {}).get("workloads", {})
    if "base" in prof:
        base = prof["base"]
        p = base["parts_ms"]
        step = base["decode_step_ms"]
        kernels = data.get("profile_decode_bfloat16", {}).get("machine", {}).get("cpu_kernels", {})
        attention = ("the C kernel workers/cpu_attention.c, reading the blocks in place; the torch gather and "
                     "two bmms took 11.3 ms at commit 2be7d98" if kernels.get("attention") else "torch ops")
        out.append(f"- **Base decode** (batch {base['decode_batch']:.0f}): {step:.1f} ms per step, of which the "
                   f"base GEMMs take {p['base_linear']:.1f} ms ({p['base_linear'] / step:.0%}), "
                   f"paged attention {p['attention']:.1f} ms ({attention}), sampling {p['sampling']:.1f} ms "
                   "and the rest (norms, rope, activations, KV writes, scheduling, detokenization) "
                   f"{p['other']:.1f} ms.")
        lora = [f"{name} {prof[w]['parts_ms']['lora']:.1f} ms ({prof[w]['parts_ms']['lora'] / step:.0%} of the base "
                f"step; the whole step grows by {prof[w]['decode_step_ms'] - step:.1f} ms)"
                for w, name in (("one", "one adapter"), ("eight", "eight adapters")) if w in prof]
        if lora:
            how = ("one call per LoRA layer (32 a step) of the C kernel lora/backends/cpu_sgmv.c: shrink and "
                   "expand together, each adapter's weights read once, bf16 dot instructions, torch's own "
                   "threads. The torch ops it replaced ran 88 small GEMMs a step (one shrink and 1-3 expands "
                   "per projection group and layer), each a few MFLOP with an inner dimension of 16 and tens "
                   "of microseconds of dispatch: 8.5 ms for one adapter and 11.2 ms for eight in the run "
                   "recorded at commit 2be7d98" if kernels.get("lora") else
                   "the torch ops (the C kernel did not build here): one shrink and 1-3 expand GEMMs per "
                   "projection group and layer, 88 a step, each costing its dispatch more than its FLOPs")
            out.append("- **LoRA per decode step**: " + ", ".join(lora) + f". That is {how}.")
    bw = data.get("bandwidth_bfloat16", {}).get("decode_sweep", {}).get("batches", {})
    if bw:
        sweep = ", ".join(f"batch {b}: {x['fraction_of_bound']:.0%}" for b, x in bw.items())
        ceilings = ", ".join(f"batch {b}: {x['ceiling_fraction_of_bound']:.0%}" for b, x in bw.items()
                             if "ceiling_fraction_of_bound" in x)
        largest = bw[max(bw, key=int)]
        ceiling = largest.get("ceiling_fraction_of_bound", 1.0)
        verdict = (f"so {TARGETS['bound_fraction']:.0%} of the bound at batch {max(bw, key=int)} is out of reach on "
                   "this CPU whatever the engine does" if ceiling < TARGETS["bound_fraction"] else
                   "so the CPU's arithmetic leaves room: the gap is the engine's")
        out.append(f"- **Bandwidth bound**: base decode reaches {sweep} of its memory-bandwidth bound. "
                   f"The base GEMMs alone, at their measured rate here, allow at most {ceilings}: past a few "
                   "sequences a CPU decode step is bound by arithmetic (each weight byte feeds one multiply-add "
                   f"per sequence), not by bytes, {verdict}. The rest of the gap to the ceiling is paged "
                   "attention, norms / rope / activations and per-step host work (see the profile).")
    tp = data.get("throughput_bfloat16", {}).get("workloads", {})
    for w in ("power_some", "power_many"):
        if w in tp and "eight" in tp:
            x = tp[w]
            budget = data["throughput_bfloat16"]["sizes"]["max_loras_per_batch"]
            loads = [r[w]["lora_stats_delta"] for r in data["throughput_bfloat16"]["rounds"]]
            host = median([d.get("host_cache_loads", 0) for d in loads])
            slots = median([d.get("slots_misses", 0) for d in loads])
            out.append(f"- **{x['label']}**: mean decode batch {x['mean_decode_batch']:.1f} against "
                       f"{tp['eight']['mean_decode_batch']:.0f} for 8 resident adapters ({x['decode_step_ms']:.0f} "
                       f"against {tp['eight']['decode_step_ms']:.0f} ms per decode step), "
                       f"{x['mean_adapters_per_decode_step']:.1f} adapters per step, {host:.0f} adapter loads from "
                       f"disk and {slots:.0f} slot loads per run. max_loras_per_batch = {budget} admits the "
                       f"requests of only {budget} adapters at a time, and with a power-law spread most "
                       "adapters have one or two requests: the batch shrinks to what the LoRA budget lets in.")
    if "power_many_wide" in tp and "eight" in tp:
        x = tp["power_many_wide"]
        out.append(f"- **{x['label']}**: the LoRA budget no longer limits the batch (mean decode batch "
                   f"{x['mean_decode_batch']:.1f}, {x['mean_adapters_per_decode_step']:.1f} adapters per step); "
                   f"{x.get('ratio_to_eight', float('nan')):.2f} of 8 resident adapters. What remains is paging "
                   "(adapter loads from disk on a background thread, which shares the two cores with the "
                   "step, and slot copies) and the LoRA of more, mostly single-token, adapters per step.")
    peer = data.get("peer_bfloat16")
    if peer:
        out.append(f"- **PEFT**: keeps {peer['peft_lora_retention']:.2f} of its own base throughput with mixed "
                   f"adapters (ours {peer['ours_lora_retention']:.2f}); on base alone we are "
                   f"{peer['ours_over_peft_base']:.1f}x faster (paged KV and continuous batching against HF's "
                   "generate loop), with mixed adapters "
                   f"{peer['ours_over_peft_mixed']:.1f}x.")
    return out + [""] if len(out) > 2 else []
