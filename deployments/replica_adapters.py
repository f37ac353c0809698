"""The adapter half of the LLMServer replica: routing a request to its adapter (Serve multiplexing), and
hot-load / unload / list, checked here before anything is published to the app's registry.

A mixin of deployments.llm_server.LLMServer: it uses the replica's `config`, `adapters` (AdapterMirror),
`metrics` and `_warm_adapter` (Serve's multiplexed loader), all set in LLMServer.__init__.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

from ray import serve

from lora.names import check_adapter_name
from lora.errors import AdapterError, AdapterNotFoundError
from lora.sources import check_source_allowed, is_hub_id


class ReplicaAdapters:
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

