"""The fleet benchmark's numbers, from the client's request records and the replicas' counters.

Counters come from 1 s polls of the app's adapter registry (`replica_stats`: each replica's last heartbeat,
its engine's stats): per replica, requests whose adapter was in host memory when they arrived
(workers/engine.py `adapter_counts`), the host cache's loads, and distinct adapters summed over steps. A
replica's total over a run is its last value minus its first (a replica started during the run: its first
heartbeat, after it loaded the configured adapters), so a replica killed mid-run keeps what it counted until its
last heartbeat.
"""
from __future__ import annotations

from benchmarks.hotload import percentile

COUNTERS = ("arrived_resident", "arrived_not_resident", "steps", "step_adapters", "loads", "misses", "evictions")


def counters(replica_stats: dict[str, dict]) -> dict[str, dict[str, int]]:
    """replica id -> COUNTERS, from one `replica_stats()` answer."""
    out = {}
    for rid, stats in replica_stats.items():
        lora = stats.get("engine", {}).get("lora", {})
        values = {**lora.get("counts", {}), **lora.get("host_cache", {})}
        out[rid] = {key: int(values.get(key, 0)) for key in COUNTERS}
    return out


def totals(polls: list[tuple[float, dict]]) -> dict[str, dict[str, int]]:
    """Per replica, what it counted between the first poll and its last one."""
    first, last = {}, {}
    for _, snapshot in polls:
        last.update(snapshot)
        first.update((rid, values) for rid, values in snapshot.items() if rid not in first)
    return {rid: {k: v - first[rid][k] for k, v in values.items()} for rid, values in last.items()}


def hit_rate(resident: int, not_resident: int) -> float | None:
    return resident / (resident + not_resident) if resident + not_resident else None


def hit_rate_series(polls: list[tuple[float, dict]], window_s: float) -> list[tuple[float, float | None, int]]:
    """(poll time, host-cache hit rate of the requests that arrived in the `window_s` before it, their count)."""
    steps, previous = [], {}
    for t, snapshot in polls:
        hits = misses = 0
        for rid, values in snapshot.items():
            before = previous.get(rid, values)
            hits += values["arrived_resident"] - before["arrived_resident"]
            misses += values["arrived_not_resident"] - before["arrived_not_resident"]
        steps.append((t, hits, misses))
        previous = {**previous, **snapshot}
    series = []
    for t, _, _ in steps:
        inside = [(h, m) for u, h, m in steps if t - window_s < u <= t]
        hits, misses = sum(h for h, _ in inside), sum(m for _, m in inside)
        series.append((t, hit_rate(hits, misses), hits + misses))
    return series


def recovery(series: list[tuple[float, float | None, int]], at: float, threshold: float) -> dict:
    """The windowed hit rate around a fault at `at`: its mean before, its lowest after, seconds from `at` until it
    is at or above `threshold` again after that low (0: it never fell below; None: never back), and the share of
    the windows from then on that stay at or above it."""
    before = [rate for t, rate, _ in series if t < at and rate is not None]
    after = [(t, rate) for t, rate, _ in series if t >= at and rate is not None]
    low_t, low = min(after, key=lambda x: x[1]) if after else (at, None)
    back = [t for t, rate in after if t >= low_t and rate >= threshold]
    since = [rate for t, rate in after if back and t >= back[0]]
    return {"before_mean": sum(before) / len(before) if before else None, "lowest_after": low,
            "back_after_s": (0.0 if low is not None and low >= threshold else back[0] - at if back else None),
            "windows_at_or_above_since": (sum(r >= threshold for r in since) / len(since)) if since else None}


def placement(records: list[dict], adapters: list[str] = ()) -> dict:
    """Where requests went against each adapter's order over the replicas seen (our router's: its home among the
    app's `adapters`, deployments/routing/prefetch.py `bounded_homes`, then rendezvous order; Serve's routing has
    none): the share served by the adapter's 1st, 2nd, ... replica, and how many adapters were served by more
    than one replica."""
    from deployments.routing.prefetch import bounded_homes
    from deployments.routing.views import rendezvous_order

    served = [r for r in records if r["replica"]]
    replicas = sorted({r["replica"] for r in served})
    homes = bounded_homes(list(adapters), replicas)   # given the app's adapters: the home first, as our router
    ranks = [0] * len(replicas)
    holders: dict[str, set] = {}
    for r in served:
        home = homes.get(r["adapter"])                # first, as our router orders them
        order = sorted(rendezvous_order(r["adapter"], replicas), key=lambda x: x != home)
        ranks[order.index(r["replica"])] += 1
        holders.setdefault(r["adapter"], set()).add(r["replica"])
    return {"served_at_hash_rank": [n / len(served) for n in ranks] if served else [],
            "adapters": len(holders), "adapters_on_several_replicas": sum(len(h) > 1 for h in holders.values())}


def imbalance(records: list[dict], num_replicas: int, window_s: float = 10.0, step_s: float = 1.0) -> dict:
    """Max / mean in-flight requests over replicas, time-averaged in `window_s` windows (sliding by `step_s`),
    from each request's replica and its send and end; the mean over `num_replicas` (an idle replica counts)."""
    spans = [(r["replica"], r["sent"], r["end"]) for r in records if r["replica"] and r["end"] is not None]
    if not spans:
        return {"p50": None, "p99": None, "windows": 0}
    begin, finish = min(s for _, s, _ in spans), max(e for _, _, e in spans)
    ratios, t = [], begin
    while t + window_s <= finish or not ratios:
        load: dict[str, float] = {}
        for replica, sent, end in spans:
            overlap = min(end, t + window_s) - max(sent, t)
            if overlap > 0:
                load[replica] = load.get(replica, 0.0) + overlap / window_s
        mean = sum(load.values()) / max(num_replicas, len(load))
        if mean > 0:
            ratios.append(max(load.values()) / mean)
        t += step_s
    return {"p50": percentile(ratios, 50), "p99": percentile(ratios, 99), "windows": len(ratios)}


def summarize(records: list[dict], polls: list[tuple[float, dict]], num_replicas: int,
              adapters: list[str] = ()) -> dict:
    ok = [r for r in records if r["outcome"] == "ok"]
    ttft = [1e3 * (r["first"] - r["sent"]) for r in ok]
    tpot = [1e3 * (r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    span = (max(r["end"] for r in ok) - min(r["sent"] for r in ok)) if ok else 0.0
    total = {k: sum(v[k] for v in totals(polls).values()) for k in COUNTERS} if polls else dict.fromkeys(COUNTERS, 0)
    minutes = span / 60 or 1.0
    return {
        "requests": len(records), "ok": len(ok),
        "errors": sum(r["outcome"] == "error" for r in records), "lost": sum(r["outcome"] == "lost" for r in records),
        "host_hit_rate": hit_rate(total["arrived_resident"], total["arrived_not_resident"]),
        "arrivals_counted": total["arrived_resident"] + total["arrived_not_resident"],
        "cold_loads": total["loads"], "cold_loads_per_replica_min": total["loads"] / num_replicas / minutes,
        "evictions": total["evictions"],
        "ttft_ms": {"p50": _p(ttft, 50), "p99": _p(ttft, 99)}, "tpot_ms": {"p50": _p(tpot, 50)},
        "output_tok_s": sum(r["tokens"] for r in ok) / span if span else 0.0,
        "imbalance": imbalance(records, num_replicas),
        "adapters_per_step": total["step_adapters"] / total["steps"] if total["steps"] else None,
        "replicas_used": len({r["replica"] for r in records if r["replica"]}),
        "placement": placement(records, adapters),
        "error_samples": sorted({r["error"] for r in records if r["error"]})[:5],
    }


def _p(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None
