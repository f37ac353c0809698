"""The fleet: FLEET.replicas LLMServer replicas on loopback Ray + Serve, FLEET.num_adapters adapters, the Azure
conversation trace's arrivals (benchmarks/fleet_workload.py), Serve's default multiplexed routing against ours
(adapter affinity, deployments/routing/) on the same arrivals.

    .venv/bin/python -m benchmarks.fleet [--quick] [--pairs 2] [--no-kill] [--rate R] [--replica-cpus C]
        [--fleet '{"max_num_seqs": 8, "max_loaded_loras": 64}'] [--routing-options '{...}']

Both applications are deployed side by side for the whole run (the same model, adapters and sizes; only
`routing` differs), so a run of one and a run of the other alternate without redeploying: per setting a, b (the
order flips from one setting to the next), Zipf 1.0 a, b, b, a with --pairs 2. Settings: Zipf s 0.8 / 1.0 / 1.2,
a drift phase (the top adapters rotate) and a hot-spot phase (one cold adapter ramps to 20% of the traffic).
Each run starts with a warm-up (FleetSpec: every adapter once, then 2 x num_adapters other draws of the
setting's popularity; 2 tokens each, sent fast), so that what is measured is the fleet in its steady state, not
the first-touch misses of a short run; then the setting's arrivals, open loop. Last, our routing with one replica
killed (ray.kill of its actor) mid-run: the windowed host-cache hit rate from 1 s polls says when it is back
above 0.9.
Results: benchmarks/results/fleet.json and fleet.md (a probe's options in the names); the request records under
.cache/fleet/.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import threading
import time
from pathlib import Path

from benchmarks.common import RESULTS, local_serve, machine_info, write_result
from benchmarks.fleet_adapters import ensure_fleet_adapters
from benchmarks.fleet_client import drive, prompt_ids
from benchmarks.fleet_metrics import counters, hit_rate_series, recovery, summarize
from benchmarks.fleet_report import markdown, row
from benchmarks.replica_cpu import ReplicaQuota
from benchmarks.fleet_workload import FLEET, TRACE_CITATION, FleetSpec, Phase, Request, adapter_names, make_workload
from benchmarks.trees import alternating

BASE = "fleet"
ROUTINGS = ("multiplex", "adapter-affinity")      # a: Serve's default, b: ours
MAX_PROMPT, MAX_OUTPUT = 96, 48                    # make_workload's clipping: the model length below fits both
SETTINGS = {"zipf-0.8": Phase(zipf_s=0.8), "zipf-1.0": Phase(zipf_s=1.0), "zipf-1.2": Phase(zipf_s=1.2),
            "drift": Phase(name="drift"), "hotspot": Phase(name="hotspot")}
ACCEPTANCE_SETTING = "zipf-1.0"
KILL_AT_S, RECOVERY_THRESHOLD, HIT_WINDOW_S = 20.0, 0.9, 5.0
DRAIN_S = 60.0                                     # unanswered this long after the last arrival: lost
SETTLE_S = 2.5                                     # > one heartbeat: the registry's stats include the last request


def app_config(routing: str, model_dir: Path, adapters: dict[str, str], spec: FleetSpec,
               routing_options: dict | None = None) -> dict:
    options = routing_options if routing == "adapter-affinity" and routing_options else {}
    return dict(model=str(model_dir), served_model_name=BASE, device="cpu", routing=routing, adapters=adapters,
                routing_options=options,
                num_replicas=spec.replicas, max_num_seqs=spec.max_num_seqs, max_loaded_loras=spec.max_loaded_loras,
                max_loras_per_batch=spec.max_loras_per_batch, max_lora_rank=spec.adapter_rank,
                max_model_len=MAX_PROMPT + MAX_OUTPUT + 16, max_ongoing_requests=spec.max_ongoing_requests,
                engine_kwargs={"kv_cache_memory_gb": 0.25})


def workloads(phase: Phase, index: int, spec: FleetSpec, duration_s: float) -> tuple[list[Request], list[Request]]:
    """(warm-up, timed) requests of one setting: the timed ones from the trace window at row 1000 * index; the
    warm-up's adapters: every adapter once, then later draws of the same popularity (steady phase); sent at
    spec.warmup_rate, 2 tokens each."""
    timed = make_workload(num_adapters=spec.num_adapters, rate=spec.rate, duration_s=duration_s, phase=phase,
                          seed=index, offset=1000 * index)
    count = spec.warmup_draws_per_adapter * spec.num_adapters
    longer = make_workload(num_adapters=spec.num_adapters, rate=spec.rate, duration_s=(len(timed) + count) / spec.rate,
                           phase=Phase(zipf_s=phase.zipf_s), seed=index, offset=1000 * index)
    every = adapter_names(spec.num_adapters)
    random.Random(index).shuffle(every)
    warm = [Request(i / spec.warmup_rate, adapter, 8, 2)
            for i, adapter in enumerate(every + [r.adapter for r in longer[len(timed):]])]
    return warm, timed


class Poller(threading.Thread):
    """Every replica's counters (their last heartbeat in the app's registry) once a second."""

    def __init__(self, app: str):
        super().__init__(daemon=True)
        import ray

        from deployments.adapter_registry import NAMESPACE, registry_name
        self.registry = ray.get_actor(registry_name(app, BASE), namespace=NAMESPACE)
        self.polls: list[tuple[float, dict]] = []
        self.stopped = threading.Event()
        self.poll()   # the run's baseline, before its first request

    def poll(self) -> None:
        import ray
        self.polls.append((time.perf_counter(), counters(ray.get(self.registry.replica_stats.remote(), timeout=10))))

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            self.poll()

    def stop(self) -> list[tuple[float, dict]]:
        self.stopped.set()
        self.join()
        self.poll()
        return self.polls


def kill_one_replica(app: str) -> str:
    """ray.kill of one of the app's LLMServer replica actors (Serve starts another); its actor name."""
    import ray
    from ray._private.state import actors

    alive = sorted(a["Name"] for a in actors(actor_state_name="ALIVE").values()
                   if a["ActorClassName"] == f"ServeReplica:{app}:LLMServer")
    ray.kill(ray.get_actor(alive[0], namespace="serve"), no_restart=True)
    return alive[0]


def run_once(url: str, app: str, warm: list[Request], timed: list[Request], seed: int, vocab_size: int,
             num_replicas: int, kill_at: float | None = None) -> dict:
    warm_prompts = [prompt_ids(i, r.prompt_tokens, vocab_size, 10_000 + seed) for i, r in enumerate(warm)]
    warm_records, _ = asyncio.run(drive(url, BASE, warm, warm_prompts, DRAIN_S))
    time.sleep(SETTLE_S)
    poller, killed, started = Poller(app), {}, {}
    poller.start()

    def on_start(start: float) -> None:
        started["at"] = start
        if kill_at is not None:
            threading.Timer(kill_at, lambda: killed.update(replica=kill_one_replica(app),
                                                           at=time.perf_counter() - start)).start()

    prompts = [prompt_ids(i, r.prompt_tokens, vocab_size, seed) for i, r in enumerate(timed)]
    records, wall = asyncio.run(drive(url, BASE, timed, prompts, DRAIN_S, on_start))
    time.sleep(SETTLE_S)
    polls = [(t - started["at"], snapshot) for t, snapshot in poller.stop()]
    out = {"summary": summarize(records, polls, num_replicas, adapter_names(FLEET.num_adapters)), "wall_s": wall,
           "warmup": {"requests": len(warm_records), "not_ok": sum(r["outcome"] != "ok" for r in warm_records)},
           "per_replica": per_replica(records)}
    series = hit_rate_series(polls, HIT_WINDOW_S)
    if kill_at is not None:
        out["kill"] = dict(killed, **recovery(series, killed.get("at", kill_at), RECOVERY_THRESHOLD),
                           hit_rate_series=[(round(t, 1), rate, n) for t, rate, n in series])
    return out | {"records": records}


def per_replica(records: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in records:
        entry = out.setdefault(r["replica"] or "none", {"requests": 0, "adapters": set()})
        entry["requests"] += 1
        entry["adapters"].add(r["adapter"])
    return {rid: {"requests": e["requests"], "adapters": len(e["adapters"])} for rid, e in sorted(out.items())}


def plan(quick: bool, pairs: int) -> list[tuple[str, str]]:
    """(setting, routing) in run order: a, b for each setting, the order flipped from one setting to the next."""
    names = [ACCEPTANCE_SETTING] if quick else list(SETTINGS)
    order = []
    for i, name in enumerate(names):
        routings = list(ROUTINGS) if i % 2 == 0 else list(ROUTINGS[::-1])
        order += [(name, r) for r in alternating(routings, pairs if name == ACCEPTANCE_SETTING else 1)]
    return order


def run_all(order: list[tuple[str, str]], runs: list[dict], url: str, fleet: FleetSpec, duration: float,
            vocab_size: int, quota: ReplicaQuota | None) -> None:
    for setting, routing in order:
        index = list(SETTINGS).index(setting)
        warm, timed = workloads(SETTINGS[setting], index, fleet, duration)
        kill = routing.endswith("+kill")
        name = app_name(routing.removesuffix("+kill"))
        before = quota.throttled_s() if quota else {}
        got = run_once(f"{url}/{name}", name, warm, timed, index, vocab_size, fleet.replicas,
                       KILL_AT_S * duration / fleet.duration_s if kill else None)
        if quota:   # seconds each replica of this app sat at its quota during the run (warm-up included)
            got["throttled_s"] = {group: round(s - before.get(group, 0.0), 2)
                                  for group, s in quota.throttled_s().items() if name in group}
        runs.append({"setting": setting, "routing": routing, **got})
        print(f"[fleet] {setting} {routing}: " + " | ".join(row(len(runs), runs[-1])[2:]) +
              (f"; hit rate back at 0.9 after {got['kill']['back_after_s']} s" if kill else ""), flush=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Zipf 1.0 only, 20 s runs, then the kill (~4 min)")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each routing at Zipf 1.0 (a, b, b, a)")
    parser.add_argument("--no-kill", action="store_true", help="skip the replica-kill run")
    parser.add_argument("--rate", type=float, default=None, help="probe another rate than FLEET.rate (req/s)")
    parser.add_argument("--replica-cpus", type=float, default=None,
                        help="a CPU quota per replica, in cores (benchmarks/replica_cpu.py; needs root)")
    parser.add_argument("--fleet", type=json.loads, default={},
                        help='FleetSpec sizes other than FLEET\'s, e.g. \'{"max_num_seqs": 8}\'')
    parser.add_argument("--routing-options", type=json.loads, default=None,
                        help='probe AffinityPolicy knobs for ours, e.g. \'{"min_spill_load": 8}\'')
    args = parser.parse_args(argv)
    fleet = dataclasses.replace(FLEET, **{"rate": args.rate or FLEET.rate, **args.fleet})
    duration = 20.0 if args.quick else fleet.duration_s
    from transformers import AutoConfig

    model_dir, adapters = ensure_fleet_adapters(fleet)
    vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
    runs: list[dict] = []
    began = time.time()
    with local_serve("lsfl-", 2 * fleet.replicas + 2) as url:
        from ray import serve

        from deployments.app import build_app
        for routing in ROUTINGS:
            t0 = time.perf_counter()
            config = app_config(routing, model_dir, adapters, fleet, args.routing_options)
            serve.run(build_app(config), name=app_name(routing),
                      route_prefix=f"/{app_name(routing)}")
            print(f"[fleet] {routing}: {fleet.replicas} replicas up in {time.perf_counter() - t0:.0f} s", flush=True)
        order = plan(args.quick, 1 if args.quick else args.pairs)
        if not args.no_kill:
            order.append((ACCEPTANCE_SETTING, "adapter-affinity+kill"))
        quota = ReplicaQuota([app_name(r) for r in ROUTINGS], args.replica_cpus) if args.replica_cpus else None
        with quota or contextlib.nullcontext():
            run_all(order, runs, url, fleet, duration, vocab_size, quota)
    records_path = Path(adapters[next(iter(adapters))]).parent.parent / f"records-{int(began)}.json"
    records_path.write_text(json.dumps([{k: r[k] for k in ("setting", "routing", "records")} for r in runs]))
    result = {"benchmark": "fleet", "quick": args.quick, "fleet": dataclasses.asdict(fleet),
              "routing_options": args.routing_options or {}, "replica_cpus": args.replica_cpus,
              "duration_s": duration, "trace": TRACE_CITATION, "machine": machine_info(),
              "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
              "wall_s": time.time() - began, "order": [f"{s}/{r}" for s, r in order],
              "runs": [{k: v for k, v in r.items() if k != "records"} for r in runs]}
    name = "fleet" + ("_quick" if args.quick else "") + (f"_rate{args.rate:g}" if args.rate else "") + (
        f"_cpus{args.replica_cpus:g}" if args.replica_cpus else "") + "".join(
        f"_{key}{value}" for key, value in sorted({**args.fleet, **(args.routing_options or {})}.items()))
    print(write_result(name, result))
    (RESULTS / f"{name}.md").write_text(markdown(result))
    return result


def app_name(routing: str) -> str:
    return f"fleet-{routing}"


if __name__ == "__main__":
    main()
