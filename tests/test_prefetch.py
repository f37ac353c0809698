"""Home prefetch (deployments/routing/prefetch.py), no Ray: every replica computes the same homes (rendezvous order,
an even share each), reads its own into host memory on a real engine, making room only from other replicas'
adapters, counting no miss, and the router sends an adapter to the replica that reports it as a home."""
from __future__ import annotations

import asyncio
import time

import pytest

from deployments.routing.policy import AffinityPolicy
from deployments.routing.prefetch import HomePrefetcher, bounded_homes
from deployments.routing.views import rendezvous_order
from factories import make_adapter
from workers import EngineConfig, LLMEngine
from workers.async_engine import AsyncLLMEngine

ME, LIVE = "replica-me", ["replica-me", "replica-other"]
NAMES = [f"p{i}" for i in range(8)]


@pytest.fixture(scope="module")
def sources(model_dir, tmp_path_factory):
    model = model_dir("qwen3")
    root = tmp_path_factory.mktemp("prefetch")
    return model, {name: str(make_adapter(model, root / name, r=4, seed=i)) for i, name in enumerate(NAMES)}


def engine_with(model, capacity: int) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(EngineConfig(model=str(model), device="cpu", max_model_len=128, max_lora_rank=4,
                                                 max_loaded_loras=capacity, max_loras_per_batch=2)))


def prefetcher(engine, sources, registered, capacity, fill=1.0) -> HomePrefetcher:
    async def live():
        return LIVE

    async def register(name):
        await engine.load_adapter(name, sources[name])
        registered[name] = sources[name]
    return HomePrefetcher(ME, live_replicas=live, adapters=lambda: sources, registered=lambda: registered,
                          register=register, engine=engine, capacity=capacity, fill=fill)


async def host(engine) -> set[str]:
    return set((await engine.stats())["lora"]["residency"]["host"])


def home_of(adapter: str, replica_ids: list[str]) -> str:
    """Plain rendezvous: the first of the adapter's order."""
    return rendezvous_order(adapter, replica_ids)[0]


def my_homes() -> list[str]:
    return sorted(a for a, r in bounded_homes(NAMES, LIVE).items() if r == ME)


def test_homes_are_an_even_share_the_same_everywhere_and_move_little():
    adapters = [f"a{i}" for i in range(200)]
    replicas = [f"r{i}" for i in range(4)]
    homes = bounded_homes(adapters, replicas)
    plain = [sum(home_of(a, replicas) == r for a in adapters) for r in replicas]
    assert max(plain) - min(plain) > 10                      # what plain rendezvous draws here: 39 to 61
    assert sorted(homes) == sorted(adapters) and all(list(homes.values()).count(r) == 50 for r in replicas)
    assert bounded_homes(adapters[::-1], replicas[::-1]) == homes              # order of the inputs: no matter
    assert sum(homes[a] == home_of(a, replicas) for a in adapters) >= 0.8 * len(adapters)   # mostly hash order
    gone = bounded_homes(adapters, replicas[1:])             # a replica leaves: its adapters move, few others
    assert sum(gone[a] != homes[a] for a in adapters if homes[a] != "r0") <= 0.05 * len(adapters)
    joined = bounded_homes(adapters, replicas + ["r4"])      # one joins: it takes an even share, few others move
    assert list(joined.values()).count("r4") == 40
    assert sum(joined[a] not in (homes[a], "r4") for a in adapters) <= 0.05 * len(adapters)
    assert bounded_homes([], replicas) == {} and bounded_homes(adapters, []) == {}


def test_the_router_sends_an_adapter_to_the_replica_reporting_it_as_home():
    policy = AffinityPolicy()
    policy.set_replicas(LIVE)
    names = NAMES * 5 + [f"x{i}" for i in range(100)]
    assert all(home_of(a, LIVE) == policy.order(a)[0] for a in names)   # nothing reported: rendezvous order
    other = {a: r for a, r in bounded_homes(names, LIVE).items() if r != ME}
    policy.report(ME, homes=[a for a in set(names) if a not in other])
    policy.report("replica-other", homes=list(other))
    assert all(policy.order(a)[0] == ("replica-other" if a in other else ME) for a in names)
    policy.report(ME, homes=list(set(names)))                # claimed by both meanwhile: the first in hash order
    assert all(policy.order(a)[0] == home_of(a, LIVE) for a in other)


def test_a_replica_reads_its_home_adapters_and_no_others(sources):
    model, paths = sources
    homes = my_homes()
    assert 0 < len(homes) < len(NAMES)
    engine = engine_with(model, capacity=8)
    try:
        registered: dict[str, str] = {}
        p = prefetcher(engine, paths, registered, capacity=8)
        started = asyncio.run(p.step())
        assert sorted(started) == homes and sorted(registered) == homes and p.homes == homes   # what it reports
        assert asyncio.run(host(engine)) == set(homes)
    finally:
        engine.close()


def test_prefetch_replaces_only_other_replicas_adapters_and_counts_no_miss(sources):
    model, paths = sources
    homes = my_homes()
    engine = engine_with(model, capacity=4)
    try:
        async def scenario():
            for name in NAMES:                     # the last four read stay; the others were evicted
                await engine.load_adapter(name, paths[name])
            registered = dict(paths)
            held = await host(engine)
            assert held - set(homes)                # some of another replica's adapters hold the cache
            p = prefetcher(engine, paths, registered, capacity=4)
            before = (await engine.stats())["lora"]["host_cache"]
            started = await p.step()                # full: only those others make room, least recently used first
            assert sorted(started) == sorted(set(homes[:4]) - held)
            deadline = time.monotonic() + 10
            while not set(homes[:4]) <= await host(engine):
                assert time.monotonic() < deadline, "prefetched adapters never became resident"
                await asyncio.sleep(0.05)
            after = (await engine.stats())["lora"]["host_cache"]
            assert after["misses"] == before["misses"]
            assert await p.step() == []             # every home held: nothing more, nothing evicted
            assert (await engine.stats())["lora"]["host_cache"]["evictions"] == after["evictions"]
        asyncio.run(scenario())
    finally:
        engine.close()
