"""Each LLMServer replica's mirror of the app's adapter registry (adapter_registry.py), applied to its engine.

The mirror reports to the registry (its applied version and stats: the
replica's heartbeat), then waits until the registry's version moves or the
next heartbeat is due (`sync_interval_s`): a long poll, so a change reaches
every replica at once and an idle app costs one report a period. On a change
it unloads adapters that were removed and reloads those whose source changed,
or whose weights another replica's hot-load found changed at the same source
(the adapter version the registry holds: the content digest of what that
hot-load read, lora/ref.py). A replica started later by
autoscaling reads the same registry, so it serves every hot-loaded adapter.
A hot-load or unload returns only once every live replica has applied it
(bounded wait), so "unloaded" means unloaded everywhere. While the registry
is down the replica keeps serving from its last copy; only a name it has
never seen, a hot-load or an unload needs the registry (a 503 meanwhile).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from deployments.adapter_registry import APPLY_TIMEOUT_S, CALL_TIMEOUT_S, RegistryClient, RegistryUnavailableError
from lora.errors import AdapterError, AdapterNotFoundError
from workers.async_engine import AsyncLLMEngine

logger = logging.getLogger("ray.serve")


class AdapterMirror:
    """One replica's view of the registry, applied to its engine. Runs on the replica's event loop."""

    def __init__(self, registry: RegistryClient, engine: AsyncLLMEngine, replica_id: str, sync_interval_s: float,
                 stats: Callable[[], Awaitable[dict]], loaded: dict[str, str]):
        self.registry = registry
        self.engine = engine
        self.replica_id = replica_id
        self.sync_interval_s = sync_interval_s
        self._stats = stats
        self.version = -1
        self.sources: dict[str, str] = {}
        self.versions: dict[str, str] = {}  # the registry's: name -> the weights its last hot-load read
        self.loaded = dict(loaded)          # name -> source, as registered in this replica's engine
        self.loaded_versions: dict[str, str | None] = {}   # name -> the registry's version when this engine read it
        self._lock = asyncio.Lock()         # one adapter change at a time in this engine
        self._sync_lock = asyncio.Lock()

    async def source_of(self, name: str) -> str:
        source = self.sources.get(name)
        if source is None:   # newer than our copy (hot-loaded moments ago), or unknown
            source = await self.registry.call(lambda registry: registry.lookup.remote(name))
        if source is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded (known: {sorted(self.sources)})")
        return source

    async def snapshot(self) -> dict[str, str]:
        """The registry's adapters now, or this replica's last copy while the registry is down."""
        try:
            _, sources, _ = await self.registry.call(lambda registry: registry.snapshot.remote())
            return sources
        except RegistryUnavailableError:
            return dict(self.sources)

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
            self.loaded[name], self.loaded_versions[name] = source, self.versions.get(name)
            return time.perf_counter() - start

    async def load(self, name: str, source: str) -> tuple[float, str]:
        """Hot-load (its name checked by the caller, ReplicaAdapters): validate by loading here, publish, and
        wait until every replica has applied it.
        Returns (seconds, "loaded" | "replaced" | "unchanged": workers/adapters.py's versions)."""
        async with self._lock:
            start = time.perf_counter()
            try:
                status = await self.engine.load_adapter(name, source)   # raises with the reason for a bad one
            except AdapterNotFoundError as exc:
                # here a missing source is a bad request (400), not an unknown model name (404)
                raise AdapterError(str(exc)) from exc
            self.loaded[name] = source
            seconds = time.perf_counter() - start
            digest = (await self.engine.stats())["lora"]["versions"][name]
            self.loaded_versions[name] = digest
        # not published (the registry is down): the next sync unloads it here again, as it is not registered.
        # Other weights from an unchanged source (its files changed): the new version makes every other replica
        # read them again
        version = await self.registry.call(lambda registry: registry.register.remote(name, source, digest))
        await self._until_applied(version)
        return seconds, status

    async def unload(self, name: str) -> None:
        version = await self.registry.call(lambda registry: registry.unregister.remote(name))
        if version is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded (known: {sorted(self.sources)})")
        await self._until_applied(version)

    async def _until_applied(self, version: int) -> None:
        await self.sync()   # this replica first, so the caller's next request here already sees it
        lagging = await self.registry.call(lambda registry: registry.wait_applied.remote(version),
                                           APPLY_TIMEOUT_S + CALL_TIMEOUT_S)
        if lagging:
            raise TimeoutError(f"{len(lagging)} replica(s) did not apply the adapter change within "
                               f"{APPLY_TIMEOUT_S:.0f}s")

    async def sync(self) -> None:
        """Report to the registry; if it changed, apply the change and report again at once."""
        async with self._sync_lock:   # two overlapping syncs could apply an older snapshot last
            current = await self._report()
            if current != self.version:
                version, sources, versions = await self.registry.call(lambda registry: registry.snapshot.remote())
                await self._apply(sources, versions)
                self.version = version
                await self._report()

    async def _report(self) -> int:
        stats = await self._safe_stats()
        return await self.registry.call(lambda registry: registry.report.remote(self.replica_id, self.version, stats))

    async def _safe_stats(self) -> dict:
        try:
            return await self._stats()
        except Exception as exc:  # noqa: BLE001  (a dead engine still reports, as unhealthy)
            return {"healthy": False, "error": repr(exc)}

    async def _apply(self, sources: dict[str, str], versions: dict[str, str]) -> None:
        async with self._lock:
            for name, old in list(self.loaded.items()):
                new, version = sources.get(name), versions.get(name)
                if new == old and version in (None, self.loaded_versions.get(name)):
                    continue
                self.loaded.pop(name)
                self.loaded_versions.pop(name, None)
                try:
                    if new is None:
                        await self.engine.unload_adapter(name)   # running requests keep their weights
                    else:
                        await self.engine.load_adapter(name, new)
                        self.loaded[name], self.loaded_versions[name] = new, version
                except AdapterError:
                    pass     # a bad new source, or old weights still in use: the next request retries
            self.sources, self.versions = sources, versions

    async def run(self) -> None:
        """The replica's background task: sync, then wait for a change or the next heartbeat, forever (errors
        are retried a period later; the registry may restart)."""
        failing = False
        while True:
            try:
                await self.sync()
                if failing:
                    logger.info("replica %s: adapter registry answers again", self.replica_id)
                failing = False
                await self.registry.call(lambda registry: registry.changes.remote(self.version, self.sync_interval_s),
                                         self.sync_interval_s + CALL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception:   # noqa: BLE001  (transient: keep serving with the last copy)
                if not failing:   # once per outage, not every interval
                    logger.warning("replica %s: adapter registry sync failed; serving from the last copy",
                                   self.replica_id, exc_info=True)
                failing = True
                await asyncio.sleep(self.sync_interval_s)

    async def close(self) -> None:
        await self.registry.call(lambda registry: registry.forget.remote(self.replica_id))
