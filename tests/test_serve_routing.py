"""Adapter-affinity routing end to end (deployments/routing/): three LLMServer replicas behind Serve's HTTP proxy.

An adapter's requests go to its home replica (rendezvous order with an even share each, which every replica
computes and reports to the routers), so the adapters partition over the replicas; a hot adapter's burst spreads
over the replicas before any of them is full. Serve's default multiplexed routing would send the burst to the
one replica holding the adapter until it rejects at max_ongoing_requests (16 here: it never would).
"""
from __future__ import annotations

import concurrent.futures
import threading

import pytest
import requests

from deployments.routing.prefetch import bounded_homes
from factories import PROMPTS, make_adapter
from serve_fixtures import wait_until

APP, BASE = "routing", "tiny"
ADAPTERS = [f"ad{i}" for i in range(6)]
REPLICA = "x-loraserve-replica"


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory, shared_serve):
    from ray import serve

    from deployments.app import build_app

    model = model_dir("qwen3")
    root = tmp_path_factory.mktemp("routing_adapters")
    adapters = {name: str(make_adapter(model, root / name, r=4, seed=i)) for i, name in enumerate(ADAPTERS)}
    # engines in the replicas' own processes (no engine process each: three replicas on two cores);
    # max_num_seqs 16 is the capacity a replica reports: a home takes 4 requests (a quarter) before it gives way,
    # so a load report a moment stale (the probe's requests just ended) moves nothing
    serve.run(build_app(dict(model=str(model), served_model_name=BASE, adapters=adapters, device="cpu",
                             max_model_len=256, max_lora_rank=4, max_num_seqs=16, num_replicas=3,
                             max_ongoing_requests=16, engine_process=False, routing_stats_period_s=0.5)),
              name=APP, route_prefix="/")
    return shared_serve


def complete(url: str, model: str, max_tokens: int = 4, prompt: str = "Hello") -> requests.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    response = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response


def replica_ids(url: str) -> list[str]:
    """The three replicas' ids, as they name themselves in the response header: found by asking for the base
    model, which goes to the least-loaded replica, until every replica answered (bounded)."""
    seen: set[str] = set()

    def probe():
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            seen.update(r.headers[REPLICA] for r in pool.map(lambda _: complete(url, BASE, max_tokens=8), range(6)))
        return len(seen) == 3
    wait_until(probe, 60, "every replica to answer a base-model request", interval=0)
    return sorted(seen)


def test_each_adapters_requests_go_to_its_home_replica(url):
    replicas = replica_ids(url)
    home = bounded_homes(ADAPTERS, replicas)   # what every replica computes and reports (two each here)
    assert sorted(home.values()) == sorted(replicas * 2)

    def one_round() -> dict[str, str]:         # one at a time: no load, so nothing spills
        return {adapter: complete(url, f"{BASE}:{adapter}").headers[REPLICA] for adapter in ADAPTERS}
    # the replicas report their homes a period after each sees all three live (their heartbeats)
    wait_until(lambda: one_round() == home, 30, "every adapter to reach its reported home", interval=0.5)
    served: dict[str, set[str]] = {}
    for _ in range(3):
        for adapter, replica in one_round().items():
            served.setdefault(adapter, set()).add(replica)
    assert served == {a: {home[a]} for a in ADAPTERS}


def test_a_hot_adapters_burst_spreads_over_the_replicas(url):
    replica_ids(url)
    adapter = ADAPTERS[0]
    # 12 at once, each long enough (64 tokens) that they overlap even on a loaded machine: with short ones
    # the first finished before the last was sent and the home replica never looked busy (17 of 24 in CI)
    start = threading.Barrier(12)

    def burst_request(i: int) -> requests.Response:
        if i < 12:
            start.wait(timeout=60)
        return complete(url, f"{BASE}:{adapter}", max_tokens=64, prompt=PROMPTS[i % len(PROMPTS)])
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(burst_request, range(24)))
    by_replica: dict[str, int] = {}
    for r in responses:
        by_replica[r.headers[REPLICA]] = by_replica.get(r.headers[REPLICA], 0) + 1
    assert len(by_replica) == 3, by_replica
    assert max(by_replica.values()) <= 0.6 * len(responses), by_replica   # not pinned to the home replica


def test_replicas_report_the_host_slots_the_short_cache_mode_counts(url):
    """record_routing_stats, as the router reads it: capacity, LoRA budget and host slots (max_loaded_loras) beside
    the residency and load."""
    from ray import serve

    from workers.config import EngineConfig
    stats = serve.get_deployment_handle("LLMServer", app_name=APP).record_routing_stats.remote().result(timeout_s=60)
    assert stats["capacity"] == 16 and stats["host_slots"] == EngineConfig.max_loaded_loras
    assert stats["lora_budget"] == EngineConfig.max_loras_per_batch and "host" in stats and "load" in stats
    assert len(stats["homes"]) == 2 and set(stats["homes"]) <= set(ADAPTERS)   # its even share of the six
