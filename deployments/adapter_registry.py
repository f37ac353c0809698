"""The cluster-wide adapter registry (a named Ray actor) and each replica's mirror of it.

The registry maps adapter name -> source for one application; every change
bumps a version. Each LLMServer replica mirrors it: it polls the version every
`sync_interval_s` (also reporting its stats), and on a change it unloads
adapters that were removed and reloads those whose source changed. A replica
started later by autoscaling reads the same registry, so it serves every
hot-loaded adapter. A hot-load or unload returns only once every live replica
has applied it (bounded wait), so "unloaded" means unloaded everywhere.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import ray

from lora.errors import AdapterError, AdapterNotFoundError
from workers.async_engine import AsyncLLMEngine

logger = logging.getLogger("ray.serve")
NAMESPACE = "loraserve"
HEAD_NODE_RESOURCE = "node:__internal_head__"   # Ray gives it to the head node only
APPLY_TIMEOUT_S = 30.0   # a replica that does not confirm within this is stuck; the caller is told


@ray.remote(num_cpus=0)
class AdapterRegistry:
    def __init__(self, stale_after_s: float):
        self._sources: dict[str, str] = {}
        self._seeded: set[tuple[str, str]] = set()
        self._version = 0
        self._stale_after_s = stale_after_s
        self._replicas: dict[str, tuple[int, float, dict]] = {}   # id -> (applied version, seen at, stats)

    async def seed(self, adapters: dict[str, str]) -> int:
        """The config's adapters. Every replica calls this at start; a (name, source) is applied once, so a
        replica started later does not bring back a configured adapter that was unloaded since."""
        fresh = {name: src for name, src in adapters.items() if (name, src) not in self._seeded}
        self._seeded.update(fresh.items())
        changed = {name: src for name, src in fresh.items() if self._sources.get(name) != src}
        if changed:
            self._sources.update(changed)
            self._version += 1
        return self._version

    async def register(self, name: str, source: str) -> int:
        if self._sources.get(name) != source:
            self._sources[name] = source
            self._version += 1
        return self._version

    async def unregister(self, name: str) -> int:
        if self._sources.pop(name, None) is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded (known: {sorted(self._sources)})")
        self._version += 1
        return self._version

    async def lookup(self, name: str) -> str | None:
        return self._sources.get(name)

    async def snapshot(self) -> tuple[int, dict[str, str]]:
        return self._version, dict(self._sources)

    async def report(self, replica_id: str, applied_version: int, stats: dict) -> int:
        """A replica's heartbeat: what it has applied, and its stats; returns the current version."""
        self._replicas[replica_id] = (applied_version, time.monotonic(), stats)
        return self._version

    async def forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    async def wait_applied(self, version: int, timeout_s: float = APPLY_TIMEOUT_S) -> list[str]:
        """Wait until every live replica has applied `version`; returns the ids that had not (empty: all did)."""
        deadline = time.monotonic() + timeout_s
        while True:
            lagging = [rid for rid, (applied, _, _) in self._live().items() if applied < version]
            if not lagging or time.monotonic() > deadline:
                return lagging
            await asyncio.sleep(0.02)

    async def replica_stats(self) -> dict[str, dict]:
        return {rid: stats for rid, (_, _, stats) in self._live().items()}

    def _live(self) -> dict[str, tuple[int, float, dict]]:
        now = time.monotonic()
        for rid in [r for r, (_, seen, _) in self._replicas.items() if now - seen > self._stale_after_s]:
            del self._replicas[rid]   # gone (downscaled or dead): it no longer holds anything up
        return self._replicas


def registry_name(app_name: str, base_model: str) -> str:
    return f"adapters:{app_name}:{base_model}"


def get_registry(app_name: str, base_model: str, sync_interval_s: float):
    """The application's registry, created by whichever replica asks first.

    Detached, so it outlives any one replica (autoscaling may stop the one that
    created it); `scheduling_strategy="DEFAULT"` keeps it out of the caller's
    placement group. On the head node (like Serve's controller): placed next to
    its first replica, it would keep that node from ever being scaled down.
    Keyed by app and base model: adapters of another base model are never
    offered to this one.
    """
    return AdapterRegistry.options(
        name=registry_name(app_name, base_model), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        scheduling_strategy="DEFAULT", resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(stale_after_s=max(3.0, 10 * sync_interval_s))


class AdapterMirror:
    """One replica's view of the registry, applied to its engine. Runs on the replica's event loop."""

    def __init__(self, registry, engine: AsyncLLMEngine, replica_id: str, sync_interval_s: float,
                 stats: Callable[[], Awaitable[dict]], loaded: dict[str, str]):
        self.registry = registry
        self.engine = engine
        self.replica_id = replica_id
        self.sync_interval_s = sync_interval_s
        self._stats = stats
        self.version = -1
        self.sources: dict[str, str] = {}
        self.loaded = dict(loaded)          # name -> source, as registered in this replica's engine
        self._lock = asyncio.Lock()         # one adapter change at a time in this engine
        self._sync_lock = asyncio.Lock()

    async def source_of(self, name: str) -> str:
        source = self.sources.get(name)
        if source is None:   # newer than our copy (hot-loaded moments ago), or unknown
            source = await self.registry.lookup.remote(name)
        if source is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded (known: {sorted(self.sources)})")
        return source

    async def ensure_loaded(self, name: str) -> float | None:
        """Load `name` into this engine if it is not there with its current source; returns seconds spent."""
        source = await self.source_of(name)
        if self.loaded.get(name) == source:
            return None
        async with self._lock:
            if self.loaded.get(name) == source:
                return None
            start = time.perf_counter()
            await self.engine.load_adapter(name, source)
            self.loaded[name] = source
            return time.perf_counter() - start

    async def load(self, name: str, source: str) -> float:
        """Hot-load: validate by loading here, publish, and wait until every replica has applied it."""
        if not name or ":" in name:
            raise AdapterError(f"adapter name {name!r} must be non-empty and contain no ':'")
        async with self._lock:
            start = time.perf_counter()
            try:
                await self.engine.load_adapter(name, source)   # raises with the reason for a bad adapter
            except AdapterNotFoundError as exc:
                # here a missing source is a bad request (400), not an unknown model name (404)
                raise AdapterError(str(exc)) from exc
            self.loaded[name] = source
            seconds = time.perf_counter() - start
        await self._publish(self.registry.register.remote(name, source))
        return seconds

    async def unload(self, name: str) -> None:
        await self._publish(self.registry.unregister.remote(name))

    async def _publish(self, change) -> None:
        version = await change
        await self.sync()   # this replica first, so the caller's next request here already sees it
        lagging = await self.registry.wait_applied.remote(version)
        if lagging:
            raise TimeoutError(f"replicas {lagging} did not apply adapter registry version {version} "
                               f"within {APPLY_TIMEOUT_S}s")

    async def sync(self) -> None:
        """Report to the registry; if it changed, apply the change and report again at once."""
        async with self._sync_lock:   # two overlapping syncs could apply an older snapshot last
            current = await self.registry.report.remote(self.replica_id, self.version, await self._safe_stats())
            if current != self.version:
                version, sources = await self.registry.snapshot.remote()
                await self._apply(sources)
                self.version = version
                await self.registry.report.remote(self.replica_id, self.version, await self._safe_stats())

    async def _safe_stats(self) -> dict:
        try:
            return await self._stats()
        except Exception as exc:  # noqa: BLE001  (a dead engine still reports, as unhealthy)
            return {"healthy": False, "error": repr(exc)}

    async def _apply(self, sources: dict[str, str]) -> None:
        async with self._lock:
            for name, old in list(self.loaded.items()):
                new = sources.get(name)
                if new == old:
                    continue
                self.loaded.pop(name)
                try:
                    if new is None:
                        await self.engine.unload_adapter(name)   # running requests keep their weights
                    else:
                        await self.engine.load_adapter(name, new)
                        self.loaded[name] = new
                except AdapterError:
                    pass     # a bad new source, or old weights still in use: the next request retries
            self.sources = sources

    async def run(self) -> None:
        """The replica's background task: sync forever (errors are retried; the registry may restart)."""
        failing = False
        while True:
            try:
                await self.sync()
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception:   # noqa: BLE001  (transient: keep serving with the last copy)
                if not failing:   # once per outage, not every interval
                    logger.warning("replica %s: adapter registry sync failed", self.replica_id, exc_info=True)
                failing = True
            await asyncio.sleep(self.sync_interval_s)

    async def close(self) -> None:
        await self.registry.forget.remote(self.replica_id)
