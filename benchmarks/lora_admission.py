"""Admission under the LoRA budget: the engine as the CLI starts it, more live adapters than its budget.

    .venv/bin/python -m benchmarks.lora_admission OLD_REV [NEW_REV=HEAD] [--rounds 3] [--rates 8] [--budgets 8]

The serving benchmark's arrivals (benchmarks.serving: S-LoRA's generator, 60 streamed requests, 8 adapters,
Poisson at each rate) against the engine alone (benchmarks.serving_engine: AsyncLLMEngine on a thread, no Ray,
no HTTP), built from the CLI's own defaults (`deployments.cli` parses `serve --model ... --lora ...`; the
replica's EngineConfig: max_loras_per_batch 4, max_num_seqs 64, rank 64, one core left to Serve). Variants,
each a process of its own on a git worktree (benchmarks.trees), order rotating every round:

    today        OLD_REV, the CLI's defaults
    new          NEW_REV, the CLI's defaults
    budget<N>    OLD_REV with --max-loras-per-batch N (N >= the adapters: a budget covering every live one)
    new_budget<N> NEW_REV with it (--new-budgets)

Reports TTFT p50 / p99 and TPOT p50 per variant and, per round, the ratios the issue judges by (TTFT p99 against
the covering budget, TPOT p50 against today), then their medians; LoRA slot loads and budget pauses per run.
"""
from __future__ import annotations

import argparse
import json

from benchmarks.common import machine_info, median, write_result
from benchmarks.trees import checkout, revision, run_child

CHILD = """
import asyncio, json, sys
from benchmarks.checkpoint import build_adapters, build_checkpoint
from benchmarks.common import FULL
from benchmarks.serving import ServingLoad, loads_at, make_requests, summarize, warm_requests
from benchmarks.serving_engine import drive
from deployments.cli import config_from_args, parse_args
from workers.engine_process import start_engine
load, rates = ServingLoad(**json.loads(sys.argv[1])), [float(r) for r in sys.argv[2].split(",")]
paths = build_adapters(load.num_adapters, FULL.shape, FULL.rank)
argv = ["serve", "--model", str(build_checkpoint("bfloat16", FULL.shape)), "--device", "cpu", *sys.argv[3:]]
for i, path in enumerate(paths):
    argv += ["--lora", f"lora-{i:04d}={path}"]
config = config_from_args(parse_args(argv))
engine = start_engine(config.replica_engine_config(), config.adapters, own_process=False)
naming = lambda adapter: None if adapter is None else f"lora-{adapter:04d}"
controller = engine.client.engine.controller
counts = lambda: (controller.adapters.slots.stats()["misses"], getattr(getattr(controller, "budget", None), "num_pauses", 0))
asyncio.run(drive(engine, warm_requests(load, FULL), naming))
out = []
for timed in loads_at(load, rates):
    before = counts()
    results, wall = asyncio.run(drive(engine, make_requests(timed, FULL.shape.vocab_size), naming))
    after = counts()
    out.append({"rate": timed.rate, "summary": summarize(results, wall), "slot_loads": after[0] - before[0],
                "budget_pauses": after[1] - before[1], "max_loras_per_batch": controller.config.max_loras_per_batch})
engine.close()
print("RESULT " + json.dumps(out))
"""


def variants(old: str, new: str, budgets: list[int], new_budgets: list[int]) -> dict[str, tuple[str, list[str]]]:
    out = {"today": (old, []), "new": (new, [])}
    out.update({f"budget{b}": (old, ["--max-loras-per-batch", str(b)]) for b in budgets})
    out.update({f"new_budget{b}": (new, ["--max-loras-per-batch", str(b)]) for b in new_budgets})
    return out


def round_ratios(got: dict, rate_index: int, covering: str) -> dict:
    """The issue's measures in one round: TTFT p99 / the covering budget's, TPOT p50 / today's."""
    s = {label: runs[rate_index]["summary"] for label, runs in got.items()}
    return {"ttft_p99_over_" + covering: {label: s[label]["ttft_ms"]["p99"] / s[covering]["ttft_ms"]["p99"]
                                         for label in s},
            "tpot_p50_over_today": {label: s[label]["tpot_ms"]["p50"] / s["today"]["tpot_ms"]["p50"] for label in s}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old")
    parser.add_argument("new", nargs="?", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rates", default="8")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--budgets", default="8", help="budgets run on OLD (the first is the covering reference)")
    parser.add_argument("--new-budgets", default="", help="budgets run on NEW too")
    args = parser.parse_args(argv)
    numbers = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    runs = variants(args.old, args.new, numbers(args.budgets), numbers(args.new_budgets))
    covering = f"budget{numbers(args.budgets)[0]}"
    trees = {rev: checkout(rev) for rev, _ in runs.values()}
    load = {"num_adapters": args.adapters, "num_requests": args.requests}
    labels, rounds = list(runs), []
    for r in range(args.rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        got = {}
        for label in order:
            rev, extra = runs[label]
            got[label] = run_child(trees[rev], CHILD, json.dumps(load), args.rates, *extra, timeout=1800)
            s = got[label][0]["summary"]
            print(f"round {r} {label}: TTFT p50 {s['ttft_ms']['p50']:.0f} p99 {s['ttft_ms']['p99']:.0f} ms, "
                  f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms, slot loads {got[label][0]['slot_loads']}, "
                  f"pauses {got[label][0]['budget_pauses']}, failed {s['failed']}", flush=True)
        rounds.append({"order": order, "results": got,
                       "ratios": [round_ratios(got, i, covering) for i in range(len(args.rates.split(",")))]})
    medians = []
    for i, rate in enumerate(args.rates.split(",")):
        per = [rd["ratios"][i] for rd in rounds]
        medians.append({"rate": float(rate), **{key: {label: median([p[key][label] for p in per]) for label in labels}
                                                for key in per[0]}})
    data = {"benchmark": "lora_admission", "old": revision(trees[args.old]), "new": revision(trees[args.new]),
            "variants": {label: {"rev": revision(trees[rev]), "cli_args": extra} for label, (rev, extra) in runs.items()},
            "load": load, "machine": machine_info(), "rounds": rounds, "medians": medians}
    print(json.dumps(medians, indent=1))
    print(write_result("lora_admission", data))
    return data


if __name__ == "__main__":
    main()
