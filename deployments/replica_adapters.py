"""The adapter half of the LLMServer replica: its adapter state started and stopped with it (the app's
registry, the AdapterMirror, Serve's multiplexed loader, the home prefetcher), routing a request to its
adapter (Serve multiplexing), and hot-load / unload / list, checked here before anything is published to the
app's registry.

A mixin of deployments.llm_server.LLMServer: it uses the replica's `config`, `_hotload_hub`, `engine`,
`replica_id`, `metrics` and `stats`, set in LLMServer.__init__ before `_start_adapters`.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

from ray import serve

from deployments.adapter_mirror import AdapterMirror
from deployments.adapter_registry import RegistryClient
from deployments.routing.prefetch import HomePrefetcher
from lora.names import check_adapter_name
from lora.errors import AdapterError, AdapterNotFoundError
from lora.sources import check_source_allowed, is_hub_id

REGISTRY_START_TIMEOUT_S = 60.0   # a registry restarting while this replica starts: wait for it, then fail


class ReplicaAdapters:
    async def _start_adapters(self, app_name: str) -> None:
        """The app's adapters on this replica: seeded into the registry, mirrored to the engine, kept in sync."""
        config = self.config
        registry = RegistryClient(app_name, config.base_model_name, config.registry_sync_interval_s)
        await registry.call(lambda actor: actor.seed.remote(config.adapters), REGISTRY_START_TIMEOUT_S)
        self.adapters = AdapterMirror(registry, self.engine, self.replica_id, config.registry_sync_interval_s,
                                      self.stats, loaded=config.adapters)
        await self.adapters.sync()
        self._sync_task = asyncio.get_running_loop().create_task(self.adapters.run())
        if config.routing == "adapter-affinity":   # this replica's share of the adapters, read before requests come
            self._prefetcher = HomePrefetcher(
                self.replica_id, live_replicas=lambda: registry.call(lambda actor: actor.live_replicas.remote()),
                adapters=lambda: self.adapters.sources, registered=lambda: self.adapters.loaded,
                register=self._ensure_loaded, engine=self.engine, capacity=config.engine.max_loaded_loras,
                period_s=config.routing_stats_period_s)
            self._prefetch_task = asyncio.get_running_loop().create_task(self._prefetcher.run())
        # Serve's per-replica LRU of adapter ids: what it reports drives routing affinity. Built here
        # because its size comes from the config; a plain function, as Serve keeps its state on it.
        async def load_for_routing(name: str) -> str:
            await self._ensure_loaded(name)
            return name

        self._warm_adapter = serve.multiplexed(max_num_models_per_replica=config.models_per_replica)(
            load_for_routing)

    async def _stop_adapters(self) -> None:
        """Only what `_start_adapters` got to build (it may have failed half-way); when the whole application is
        being deleted, its adapter registry goes with it."""
        if hasattr(self, "_prefetch_task"):
            self._prefetch_task.cancel()
        if hasattr(self, "_sync_task"):
            self._sync_task.cancel()
            if not await self.adapters.registry.release_if_app_deleted():
                try:
                    await self.adapters.close()
                except Exception:  # noqa: BLE001  (the registry may be down: it forgets us when we go stale)
                    pass

    async def _adapter_for_request(self) -> str | None:
        name = serve.get_multiplexed_model_id()
        if not name:
            return None
        await self.adapters.source_of(name)   # unknown: a 404 here, not an ERROR line from Serve's loader
        await self._warm_adapter(name)        # first use on this replica loads it; Serve learns we hold it
        await self._ensure_loaded(name)       # the registry may have changed since it was warmed
        return name

    async def _ensure_loaded(self, name: str) -> None:
        try:
            seconds = await self.adapters.ensure_loaded(name)
        except AdapterNotFoundError:
            raise                                  # an unknown name, not a failed load
        except AdapterError:
            self.metrics.record_adapter_load(None, ok=False)
            raise
        if seconds is not None:
            self.metrics.record_adapter_load(seconds, ok=True)

    async def load_adapter(self, name: str, source: str, *, replace: bool = False) -> dict[str, Any]:
        """Hot-load: validated here (AdapterError says why not), then published to every replica.

        `source` is an absolute directory or a Hub id: a relative path would name a place in the
        replica's working directory, which is not the caller's. Adapters of the config are fixed for
        the deployment's life; a hot-loaded name takes a new source only with `replace=True`.
        """
        check_adapter_name(name, self.config.base_model_name)
        source = os.fspath(source) if isinstance(source, os.PathLike) else source
        if not isinstance(source, str) or not (source.startswith("/") or is_hub_id(source)):
            raise AdapterError(f"adapter {name!r}: lora_path {str(source)[:200]!r} must be an absolute directory or a "
                               "Hub id (org/name[@revision]); relative paths are refused")
        self._check_not_configured(name, "replaced")
        # the hot-load roots alone (the engine's roots also hold the configured adapters' directories)
        await asyncio.to_thread(check_source_allowed, name, source, self.config.engine.adapter_roots,
                                self._hotload_hub)
        try:
            current = await self.adapters.source_of(name)
        except AdapterNotFoundError:
            current = None
        if current not in (None, source) and not replace:
            raise AdapterError(f"adapter {name!r} is already loaded from another source; send \"replace\": true "
                               "to replace it")
        try:
            seconds, status = await self.adapters.load(name, source)
        except AdapterError:
            self.metrics.record_adapter_load(None, ok=False)
            raise
        self.metrics.record_adapter_load(seconds, ok=True)
        await self._warm_adapter(name)
        return {"lora_name": name, "lora_path": source, "load_seconds": seconds, "status": status}

    async def unload_adapter(self, name: str) -> dict[str, Any]:
        """Unknown name: AdapterNotFoundError. Running requests finish with the weights they started with."""
        self._check_not_configured(name, "unloaded")
        await self.adapters.unload(name)
        return {"lora_name": name}

    def _check_not_configured(self, name: str, action: str) -> None:
        if name in self.config.adapters:
            raise AdapterError(f"adapter {name!r} is part of the deployment's configuration; it cannot be {action} "
                               "at run time (change the config and redeploy)")

    async def list_adapters(self) -> dict[str, str]:
        """Name -> source of every adapter of the app (this replica's last copy while the registry restarts)."""
        return await self.adapters.snapshot()

