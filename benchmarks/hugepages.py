"""Batch-32 base decode with glibc's malloc asking for transparent huge pages (GLIBC_TUNABLES=glibc.malloc.hugetlb=1)
against without, in alternating processes.

    .venv/bin/python -m benchmarks.hugepages       (about two minutes)

Why: with THP in `madvise` mode (the common default) no tensor memory is backed by huge pages unless asked, and
a decode step streams every weight: its TLB misses (two-level page walks under a hypervisor) show in the GEMMs.
The tunable must be set before a process starts (glibc reads it once), so each variant is its own process, the
same engine and prompts (kernels on, LoRA off). Writes results/hugepages.json and .md.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from statistics import median

from benchmarks.common import FULL, RESULTS, machine_info, sizes_dict, write_result

TUNABLE = "glibc.malloc.hugetlb=1"


def child(repeats: int = 4) -> None:
    from benchmarks.checkpoint import build_checkpoint
    from benchmarks.common import make_engine, make_prompts, run_requests, set_threads

    set_threads(FULL.threads)
    engine = make_engine(build_checkpoint("bfloat16", FULL.shape), "bfloat16", FULL, enable_lora=False)
    prompts = make_prompts(FULL)[:FULL.batch]
    run_requests(engine, prompts, [None] * len(prompts), 4)   # warm-up
    steps = []
    for _ in range(repeats):
        timing = run_requests(engine, prompts, [None] * len(prompts), FULL.max_tokens)
        steps.append(timing.decode_s / timing.decode_steps * 1e3)
    engine.close()
    print(json.dumps({"step_ms": steps}))


def run(pairs: int = 3, log=print) -> dict:
    runs = {"default": [], "hugetlb": []}
    for i in range(pairs):
        for name in ("default", "hugetlb") if i % 2 == 0 else ("hugetlb", "default"):
            env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
            if name == "hugetlb":
                env["GLIBC_TUNABLES"] = TUNABLE
            done = subprocess.run([sys.executable, "-m", "benchmarks.hugepages", "--child"], env=env, check=True,
                                  capture_output=True, text=True, timeout=600)
            steps = json.loads(done.stdout.strip().splitlines()[-1])["step_ms"]
            runs[name].append(median(steps))
            log(f"[hugepages] pair {i} {name:>8}: {median(steps):.1f} ms/step (runs {[round(s, 1) for s in steps]})")
    ratios = [h / d for h, d in zip(runs["hugetlb"], runs["default"])]
    return {"benchmark": "hugepages", "sizes": sizes_dict(FULL), "machine": machine_info(), "tunable": TUNABLE,
            "step_ms": runs, "hugetlb_over_default": ratios}


def markdown(data: dict) -> str:
    d, h = data["step_ms"]["default"], data["step_ms"]["hugetlb"]
    return "\n".join([
        f"# Batch-{data['sizes']['batch']} base decode step, glibc malloc with / without transparent huge pages", "",
        "`.venv/bin/python -m benchmarks.hugepages`: one process per run, alternating; median ms per decode step.",
        "", "| pair | default | GLIBC_TUNABLES=" + data["tunable"] + " | ratio |", "|---|---|---|---|",
        *[f"| {i} | {a:.1f} | {b:.1f} | {b / a:.3f} |" for i, (a, b) in enumerate(zip(d, h))], ""])


def main(argv=None) -> dict | None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--child"]:
        child()
        return None
    data = run()
    print(write_result("hugepages", data))
    (RESULTS / "hugepages.md").write_text(markdown(data))
    return data


if __name__ == "__main__":
    main()
