"""HostAdapterCache: LRU, pinning, reference counts, background loads, stats."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch

from lora.adapter import LoRAAdapter, LoRAWeights
from lora.cache import HostAdapterCache
from lora.errors import AdapterError, AdapterNotFoundError
from lora.ref import AdapterRef

WAIT_S = 5.0  # upper bound for a background load; the loads here take microseconds


def fake_adapter(name: str, source: str, rank: int = 2) -> LoRAAdapter:
    weights = {(0, "q_proj"): LoRAWeights(torch.randn(rank, 8), torch.randn(8, rank), 2.0)}
    return LoRAAdapter(name, source, rank, frozenset({"q_proj"}), weights)


class FakeLoader:
    """load_fn recording its calls; `gate` (if set) blocks loads, `errors` makes them fail."""

    def __init__(self, gate: threading.Event | None = None):
        self.calls: list[tuple[str, str]] = []
        self.gate = gate
        self.started = threading.Event()
        self.errors: dict[str, Exception] = {}

    def __call__(self, name: str, source: str) -> LoRAAdapter:
        self.calls.append((name, source))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S), "test never opened the gate"
        if name in self.errors:
            raise self.errors[name]
        return fake_adapter(name, source)


def wait_until(predicate) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "background load did not finish"
        time.sleep(0.001)


@pytest.fixture
def make_cache():
    caches = []

    def make(capacity: int, loader=None, executor=None, names=("a", "b", "c", "d")):
        cache = HostAdapterCache(capacity, loader or FakeLoader(), executor)
        for name in names:
            cache.register(name, f"/adapters/{name}")
        caches.append(cache)
        return cache

    yield make
    for cache in caches:
        cache.close()


def test_lru_eviction_at_capacity(make_cache):
    cache = make_cache(2)
    a = cache.load_now("a")
    cache.load_now("b")
    assert cache.get("a") is a  # touch: b is now the least recently used
    cache.load_now("c")
    assert [cache.is_resident(n) for n in "abc"] == [True, False, True]
    assert cache.get("b") is None
    assert cache.is_registered("b")  # evicted, not forgotten
    stats = cache.stats()
    assert (stats["loads"], stats["evictions"], stats["resident"]) == (3, 1, 2)
    assert cache.load_now("a") is a  # resident: no reload
    assert cache.stats()["loads"] == 3


def test_a_load_evicts_a_preferred_copy_from_the_older_half_first(make_cache):
    names = [f"n{i}" for i in range(6)]
    cache = make_cache(4, names=names)
    for name in names[:4]:                   # LRU order n0 n1 n2 n3
        cache.load_now(name)
    cache.prefer_evicting({"n1", "n3"})      # copies of adapters this replica is not the home of
    assert cache.residency()["evicts_next"] == "n1"          # n1 in the older half goes before n0
    cache.load_now("n4")
    assert [cache.is_resident(n) for n in names[:5]] == [True, False, True, True, True]
    cache.acquire("n0")                      # held: never a victim; evictable now n2 n3 n4, older half n2
    cache.load_now("n5")                     # n3 is preferred but young: the LRU n2 goes
    assert [cache.is_resident(n) for n in names] == [True, False, False, True, True, True]
    cache.release("n0")
    cache.prefer_evicting(())                # plain LRU again
    assert cache.residency()["evicts_next"] == "n3"


def test_referenced_and_pinned_are_never_evicted(make_cache):
    cache = make_cache(2)
    cache.register("p", "/adapters/p", pinned=True)
    cache.load_now("p")
    cache.load_now("a")
    cache.acquire("a")
    cache.load_now("b")  # nothing evictable: over capacity until a is released
    assert [cache.is_resident(n) for n in ("p", "a", "b")] == [True, True, True]
    cache.load_now("c")  # b (unreferenced, unpinned) goes; c, just inserted, stays
    assert [cache.is_resident(n) for n in ("p", "a", "b", "c")] == [True, True, False, True]
    cache.release("a")  # back to capacity: a is now the LRU unreferenced adapter
    assert [cache.is_resident(n) for n in ("p", "a", "c")] == [True, False, True]
    assert cache.stats()["evictions"] == 2
    cache.register("p", "/adapters/p", pinned=False)  # unpin
    cache.load_now("d")
    assert not cache.is_resident("p")


def test_ensure_loads_in_background():
    gate = threading.Event()
    loader = FakeLoader(gate)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as executor:
        cache = HostAdapterCache(2, loader, executor)
        cache.register("a", "/adapters/a")
        assert cache.ensure("a") is False
        assert loader.started.wait(WAIT_S)
        assert cache.ensure("a") is False  # loading: no second load
        assert cache.stats()["loading"] == 1 and not cache.is_resident("a")
        gate.set()
        wait_until(lambda: cache.is_resident("a"))
        assert cache.ensure("a") is True
        assert loader.calls == [("a", "/adapters/a")]
        stats = cache.stats()
        assert (stats["hits"], stats["misses"], stats["loads"], stats["loading"]) == (1, 1, 1, 0)
        assert stats["load_seconds_total"] > 0 and len(stats["recent_load_seconds"]) == 1
        cache.close()  # an injected executor stays usable for its owner
        assert executor.submit(lambda: 1).result(WAIT_S) == 1


def test_evicted_adapter_is_reloaded_from_its_source(make_cache):
    loader = FakeLoader()
    cache = make_cache(1, loader)
    cache.load_now("a")
    cache.load_now("b")
    assert cache.ensure("a") is False
    wait_until(lambda: cache.is_resident("a"))
    assert cache.ensure("a") is True
    assert loader.calls == [("a", "/adapters/a"), ("b", "/adapters/b"), ("a", "/adapters/a")]


@pytest.mark.parametrize("error", [AdapterError("adapter 'a': rank 99 > 64"), OSError("disk")])
def test_failed_load_surfaces_once_then_retries(make_cache, error):
    loader = FakeLoader()
    loader.errors["a"] = error
    cache = make_cache(2, loader)
    assert cache.ensure("a") is False
    wait_until(lambda: cache.stats()["load_failures"] == 1 and cache.stats()["loading"] == 0)
    with pytest.raises(AdapterError) as info:
        cache.ensure("a")
    assert info.value is error or info.value.__cause__ is error
    del loader.errors["a"]
    assert cache.ensure("a") is False  # error cleared: retried
    wait_until(lambda: cache.is_resident("a"))
    stats = cache.stats()
    assert (stats["misses"], stats["loads"], stats["load_failures"]) == (2, 1, 1)


def test_load_now_errors_propagate(make_cache):
    loader = FakeLoader()
    loader.errors["a"] = AdapterError("adapter 'a': bad config")
    cache = make_cache(2, loader)
    with pytest.raises(AdapterError, match="bad config"):
        cache.load_now("a")
    with pytest.raises(AdapterNotFoundError):
        cache.load_now("unknown")
    assert not cache.is_resident("a") and cache.stats()["load_failures"] == 1


def test_unregister_while_referenced_keeps_weights_until_release(make_cache):
    cache = make_cache(2)
    a = cache.load_now("a")
    assert cache.acquire("a") is a
    cache.acquire("a")
    cache.unregister("a")
    assert not cache.is_registered("a")
    for call in (cache.ensure, cache.acquire, cache.unregister):
        with pytest.raises(AdapterNotFoundError):
            call("a")
    assert cache.is_resident("a") and cache.get("a") is a
    cache.release("a")
    assert cache.is_resident("a")
    cache.release("a")
    assert not cache.is_resident("a")
    with pytest.raises(RuntimeError):
        cache.release("a")
    cache.load_now("b")
    cache.unregister("b")  # unreferenced: freed now
    assert not cache.is_resident("b")


def test_a_version_is_one_entry_whatever_its_source_or_pin(make_cache):
    """Keys are adapter versions (lora/ref.py): the same weights registered from another source stay resident,
    held by running requests, and are paged back in from the new source; another version is another entry."""
    loader = FakeLoader()
    cache = make_cache(1, loader, names=())
    v1 = AdapterRef("a", "v1", "/adapters/a")
    cache.register(v1, v1.source)
    held = cache.load_now(v1)
    cache.acquire(v1)
    moved = AdapterRef("a", "v1", "/elsewhere/a", pinned=True)
    cache.register(moved, moved.source)              # allowed while referenced: the weights are the same
    assert cache.is_resident(v1) and cache.get(moved) is held and cache.is_registered(AdapterRef("a", "v1"))
    assert not cache.is_registered(AdapterRef("a", "v2", "/adapters/a"))
    cache.release(v1)
    v2 = AdapterRef("a", "v2", "/adapters/a")
    cache.register(v2, v2.source)
    cache.load_now(v2)                               # evicts v1 (capacity 1)
    assert not cache.is_resident(v1)
    cache.load_now(v1)
    assert loader.calls[-1] == (v1, "/elsewhere/a")


def test_unregister_during_load_drops_the_result(make_cache):
    gate = threading.Event()
    loader = FakeLoader(gate)
    cache = make_cache(2, loader)
    assert cache.ensure("a") is False
    assert loader.started.wait(WAIT_S)
    cache.unregister("a")
    gate.set()
    wait_until(lambda: cache.stats()["loads"] == 1)
    assert not cache.is_resident("a") and cache.stats()["resident"] == 0


def test_acquire_needs_a_resident_adapter(make_cache):
    cache = make_cache(2)
    with pytest.raises(AdapterError, match="not resident"):
        cache.acquire("a")
    with pytest.raises(AdapterNotFoundError):
        cache.ensure("zzz")
    cache.load_now("a")
    cache.acquire("a")
    stats = cache.stats()
    assert stats["referenced"] == 1 and stats["resident_bytes"] == cache.get("a").nbytes()
