"""Home prefetch (deployments/routing/prefetch.py), no Ray: a replica reads into host memory the adapters it heads
the rendezvous order of, on a real engine, making room only from other replicas' adapters, counting no miss."""
from __future__ import annotations

import asyncio
import time

import pytest

from deployments.routing.policy import AffinityPolicy
from deployments.routing.prefetch import HomePrefetcher, home_of
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


def test_homes_are_the_routers_first_choice():
    policy = AffinityPolicy()
    policy.set_replicas(LIVE)
    assert all(home_of(a, LIVE) == policy.order(a)[0] for a in NAMES * 5 + [f"x{i}" for i in range(100)])


def test_a_replica_reads_its_home_adapters_and_no_others(sources):
    model, paths = sources
    homes = sorted(a for a in NAMES if home_of(a, LIVE) == ME)
    assert 0 < len(homes) < len(NAMES)
    engine = engine_with(model, capacity=8)
    try:
        registered: dict[str, str] = {}
        started = asyncio.run(prefetcher(engine, paths, registered, capacity=8).step())
        assert sorted(started) == homes and sorted(registered) == homes
        assert asyncio.run(host(engine)) == set(homes)
    finally:
        engine.close()


def test_prefetch_replaces_only_other_replicas_adapters_and_counts_no_miss(sources):
    model, paths = sources
    homes = sorted(a for a in NAMES if home_of(a, LIVE) == ME)
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
