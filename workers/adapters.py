"""The engine's view of adapters: registry + host cache + device slot assignment.

Lives with the controller. Loads happen on a background thread (the host
cache's executor), so the step loop never waits on disk or the Hub.
"""
from __future__ import annotations

import concurrent.futures

from lora.adapter import LoRAAdapter, LoRAModelSpec, check_adapter_name, load_adapter
from lora.cache import HostAdapterCache
from lora.errors import AdapterError, AdapterNotFoundError
from lora.slots import SlotTable


class AdapterManager:
    def __init__(self, spec: LoRAModelSpec, *, max_lora_rank: int, max_loaded_loras: int,
                 max_loras_per_batch: int, adapter_roots: tuple[str, ...] = (), allow_hub: bool = True,
                 pin_memory: bool = False, load_timeout_s: float | None = None):
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = max_loras_per_batch
        self.adapter_roots, self.allow_hub = adapter_roots, allow_hub
        self.pin_memory = pin_memory    # page-locked host copies make slot loads async DMA on accelerators
        self.cache = HostAdapterCache(max_loaded_loras, self._load, load_timeout_s=load_timeout_s)
        self.slots = SlotTable(max_loras_per_batch)
        self.pinned: set[str] = set()

    def _load(self, name: str, source: str) -> LoRAAdapter:
        adapter = load_adapter(name, source, self.spec, max_lora_rank=self.max_lora_rank,
                               adapter_roots=self.adapter_roots or None, allow_hub=self.allow_hub)
        if self.pin_memory:
            for weights in adapter.weights.values():
                weights.lora_a, weights.lora_b = weights.lora_a.pin_memory(), weights.lora_b.pin_memory()
        return adapter

    # ---- user operations -------------------------------------------------
    def read(self, name: str, source: str) -> concurrent.futures.Future:
        """Read and validate an adapter on the load threads (nothing registered): a Future of what `load`
        takes as `preloaded`. How the async engine keeps file reads off its step thread."""
        return self.cache.read(name, source)

    def load(self, name: str, source: str, pinned: bool = False,
             preloaded: tuple[LoRAAdapter, float] | None = None) -> LoRAAdapter:
        """Register and load now (or insert `preloaded`), so a bad adapter is refused at once with its reason.

        A new source for a known name replaces it (refused while running requests use the old
        weights); if the new source is invalid the old one stays registered.
        """
        check_adapter_name(name)
        if pinned and name not in self.pinned and len(self.pinned) + 1 >= self.max_loras_per_batch:
            raise AdapterError(f"adapter {name!r}: pinning it would leave no free slot "
                               f"(max_loras_per_batch={self.max_loras_per_batch})")
        previous = self.cache.registered().get(name)
        self.cache.register(name, source, pinned=pinned)
        if previous not in (None, source):
            self.slots.remove(name)          # the slot holds the replaced weights
        try:
            adapter = self.cache.load_now(name, preloaded)
        except Exception:
            if previous not in (None, source):
                self.cache.register(name, previous, pinned=name in self.pinned)
            else:
                self.cache.unregister(name)
            raise
        if pinned:
            self.pinned.add(name)
        else:
            self.pinned.discard(name)
        return adapter

    def unload(self, name: str) -> None:
        """New requests are refused at once; running ones keep their weights until they finish."""
        if not self.cache.is_registered(name):
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        self.cache.unregister(name)
        self.pinned.discard(name)
        self._forget_if_unused(name)

    def list(self) -> dict[str, str]:
        return self.cache.registered()

    def check_known(self, name: str) -> None:
        if not self.cache.is_registered(name):
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded (known: {sorted(self.list())})")

    # ---- controller operations -------------------------------------------
    def ensure(self, name: str) -> bool:
        """True when resident in host memory; otherwise a background load is started."""
        self.check_known(name)
        return self.cache.ensure(name)

    def acquire(self, name: str) -> None:
        self.cache.acquire(name)

    def release(self, name: str) -> None:
        self.cache.release(name)
        self._forget_if_unused(name)

    def assign_slots(self, names: set[str]) -> list[tuple[int, str, str, int]]:
        """Give every adapter of the batch a slot; returns the loads (slot, name, source, load id)."""
        loads = self.slots.assign(sorted(names), pinned=self.pinned)
        registered = self.cache.registered()
        return [(slot, name, registered[name], self.cache.load_id(name)) for slot, name in loads]

    def load_id(self, name: str) -> int:
        """Which read of the adapter's files is resident: part of its KV's prefix-cache identity."""
        return self.cache.load_id(name)

    def forget_slot(self, name: str) -> None:
        """The adapter's slot holds nothing usable (a rank failed to install it): the next batch loads it anew."""
        self.slots.remove(name)

    def slot_of(self, name: str | None) -> int:
        return -1 if name is None else self.slots.slot_of(name)

    def _forget_if_unused(self, name: str) -> None:
        if not self.cache.is_registered(name) and not self.cache.is_resident(name):
            self.slots.remove(name)

    def stats(self) -> dict:
        return {"host_cache": self.cache.stats(), "slots": self.slots.stats()}

    def close(self) -> None:
        self.cache.close()
