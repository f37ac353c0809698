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
        out.append(f"- **Base decode** (batch {base['decode_batch']:.0f}): {step:.1f} ms per step, of which the "
                   f"base GEMMs take {p['base_linear']:.1f} ms ({p['base_linear'] / step:.0%}), "
                   f"paged attention {p['attention']:.1f} ms, sampling {p['sampling']:.1f} ms and the rest (norms, "
                   f"rope, activations, KV writes, scheduling, detokenization) {p['other']:.1f} ms.")
        lora = [f"{name} {prof[w]['parts_ms']['lora']:.1f} ms ({prof[w]['parts_ms']['lora'] / step:.0%} of the base "
                f"step; the whole step grows by {prof[w]['decode_step_ms'] - step:.1f} ms)"
                for w, name in (("one", "one adapter"), ("eight", "eight adapters")) if w in prof]
        if lora:
            out.append("- **LoRA per decode step**: " + ", ".join(lora) + ". That is one shrink and 1-3 expand "
                       "GEMMs per projection group and layer (88 a step), each a few MFLOP with an inner "
                       "dimension of 16: on CPU each costs tens of microseconds, while one adapter's FLOPs and "
                       "bytes are under 2% of the base model's. Closing the gap needs fewer, fused LoRA ops "
                       "(a shrink-expand kernel, or the delta added inside the base GEMM), not fewer bytes.")
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
                   "(adapter loads from disk on a background thread, slot copies) and the padded batched LoRA "
                   "over more, mostly single-token, adapters per step.")
    peer = data.get("peer_bfloat16")
    if peer:
        out.append(f"- **PEFT**: keeps {peer['peft_lora_retention']:.2f} of its own base throughput with mixed "
                   f"adapters (ours {peer['ours_lora_retention']:.2f}); on base alone we are "
                   f"{peer['ours_over_peft_base']:.1f}x faster (paged KV and continuous batching against HF's "
                   "generate loop), with mixed adapters "
                   f"{peer['ours_over_peft_mixed']:.1f}x.")
    return out + [""] if len(out) > 2 else []
