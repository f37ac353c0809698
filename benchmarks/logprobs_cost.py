"""What a decode step pays for logprobs: the same batch with every request asking for its tokens' logprobs, and
with none asking (served requests compute them only when the answer shows them, or best_of > n ranks by them).

    .venv/bin/python -m benchmarks.logprobs_cost [--threads 2] [--rounds 5]

The bench checkpoint (bf16), batch 32, greedy, base model; one engine, the two runs alternating in every round
(each round starts at the other), medians of the per-round decode step times and of their ratio. The process runs
as an engine process does (glibc's malloc on huge pages). Writes results/logprobs_cost.json.
"""
from __future__ import annotations

import argparse
from statistics import median

from benchmarks.checkpoint import build_checkpoint
from benchmarks.common import FULL, as_engine_process, machine_info, make_engine, make_prompts, run_requests, set_threads, write_result


def main(argv=None) -> dict:
    as_engine_process("benchmarks.logprobs_cost", argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=FULL.threads)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    set_threads(args.threads)
    engine = make_engine(build_checkpoint("bfloat16", FULL.shape), "bfloat16", FULL, enable_lora=False)
    prompts = make_prompts(FULL)[:FULL.batch]
    base = [None] * len(prompts)
    step_ms = {False: [], True: []}
    try:
        for logprobs in (False, True):
            run_requests(engine, prompts, base, 4, logprobs)   # warm-up
        for r in range(args.rounds):
            for logprobs in ((False, True) if r % 2 == 0 else (True, False)):
                t = run_requests(engine, prompts, base, FULL.max_tokens, logprobs)
                step_ms[logprobs].append(t.decode_s / t.decode_steps * 1e3)
                print(f"round {r} logprobs={logprobs}: {step_ms[logprobs][-1]:.2f} ms a decode step", flush=True)
    finally:
        engine.close()
    ratios = [on / off for on, off in zip(step_ms[True], step_ms[False])]
    data = {"benchmark": "logprobs_cost", "batch": FULL.batch, "threads": args.threads,
            "step_ms_without": median(step_ms[False]), "step_ms_with": median(step_ms[True]),
            "with_over_without": median(ratios), "rounds": {"without": step_ms[False], "with": step_ms[True]},
            "machine": machine_info()}
    print(write_result("logprobs_cost", data), data["with_over_without"])
    return data


if __name__ == "__main__":
    main()
