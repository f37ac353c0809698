"""The engine's view of adapters: registry + host cache + device slot assignment.

Lives with the controller. Loads happen on a background thread (the host
cache's executor), so the step loop never waits on disk or the Hub.

Versions (as vLLM's adapter ids: a new version is a new id): every load of a name is one version,
identified by the content of its weights. The host cache and the slots hold versions, keyed
`name@N`; a request resolves its name to the current version when it is admitted and keeps that
version to its end. Loading a name again with other weights (changed files, another source)
makes a new version that new requests get, beside the old one, which is freed when its last
request ends; loading the same weights again is a no-op.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import itertools

import torch

from lora.adapter import LoRAAdapter, LoRAModelSpec, load_adapter
from lora.names import check_adapter_name
from lora.cache import HostAdapterCache
from lora.errors import AdapterError, AdapterNotFoundError
from lora.modules import EXPERT_MODULES
from lora.slots import SlotTable


def content_version(adapter: LoRAAdapter) -> str:
    """A digest of what the adapter adds to the model: its weights and scalings, module by module."""
    digest = hashlib.sha256()
    for (layer, module), weights in sorted(adapter.weights.items()):
        digest.update(f"{layer}.{module}:{weights.scaling!r}".encode())
        for t in (weights.lora_a, weights.lora_b):
            digest.update(str((t.dtype, tuple(t.shape))).encode())
            digest.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def display_name(key: str) -> str:
    """The adapter name of a version key (names have no '@')."""
    return key.split("@", 1)[0]


class AdapterManager:
    def __init__(self, spec: LoRAModelSpec, *, max_lora_rank: int, max_loaded_loras: int,
                 max_loras_per_batch: int, adapter_roots: tuple[str, ...] = (), allow_hub: bool = True,
                 pin_memory: bool = False, load_timeout_s: float | None = None, max_expert_loras: int | None = None):
        self.spec = spec
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = max_loras_per_batch
        self.adapter_roots, self.allow_hub = adapter_roots, allow_hub
        self.pin_memory = pin_memory    # page-locked host copies make slot loads async DMA on accelerators
        self.cache = HostAdapterCache(max_loaded_loras, self._load, load_timeout_s=load_timeout_s)
        self.slots = SlotTable(max_loras_per_batch)
        # MoE: adapters with expert weights also take one of these (fewer: their buffers are large)
        self.max_expert_loras = max_expert_loras or max_loras_per_batch
        self.expert_slots = SlotTable(self.max_expert_loras)
        self._has_experts: dict[str, bool] = {}    # key -> the version has expert weights
        self.pinned: set[str] = set()             # version keys that keep their slot
        self._current: dict[str, str] = {}         # name -> key of the version new requests get
        self._versions: dict[str, str] = {}        # key -> content version of its weights
        self._generation = itertools.count(1)

    def _load(self, key: str, source: str) -> LoRAAdapter:
        """Read and validate (the load threads). A version paged back in after eviction must be the
        version that was checked: files changed since then are refused, never served in its place."""
        name = display_name(key)
        adapter = load_adapter(name, source, self.spec, max_lora_rank=self.max_lora_rank,
                               adapter_roots=self.adapter_roots or None, allow_hub=self.allow_hub)
        expected, got = self._versions.get(key), content_version(adapter)
        if expected is not None and got != expected:
            raise AdapterError(f"adapter {name!r}: its files changed since it was loaded (version {expected}, the "
                               f"files now hold {got}); load it again to serve the new weights")
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
             preloaded: tuple[LoRAAdapter, float] | None = None) -> str:
        """Read (or take `preloaded`) and register a version of `name`, so a bad adapter is refused at once with
        its reason and the current version stays. Returns "loaded", "replaced" (a new version: new requests get
        it, running ones finish on theirs) or "unchanged" (the same source and weights: nothing to do)."""
        check_adapter_name(name)
        current = self._current.get(name)
        pinned_keys = self.pinned - {current}
        if pinned and current not in self.pinned and len(pinned_keys) + 1 >= self.max_loras_per_batch:
            raise AdapterError(f"adapter {name!r}: pinning it would leave no free slot "
                               f"(max_loras_per_batch={self.max_loras_per_batch})")
        adapter = preloaded[0] if preloaded is not None else self._load(name, source)
        has_experts = any(module in EXPERT_MODULES for _, module in adapter.weights)
        if pinned and has_experts and current not in self.pinned and \
                sum(map(self.uses_experts, pinned_keys)) + 1 >= self.max_expert_loras:
            raise AdapterError(f"adapter {name!r}: pinning it would leave no free expert slot "
                               f"(max_expert_loras={self.max_expert_loras})")
        version = content_version(adapter)
        if current is not None and self._versions[current] == version and self.cache.registered()[current] == source:
            self.cache.register(current, source, pinned=pinned)
            self._pin(current, pinned)
            return "unchanged"
        key = f"{name}@{next(self._generation)}"
        self._versions[key] = version
        self._has_experts[key] = has_experts
        self.cache.register(key, source, pinned=pinned)
        try:
            self.cache.load_now(key, preloaded or (adapter, 0.0))
        except Exception:
            self.cache.unregister(key)
            del self._versions[key]
            raise
        self._current[name] = key
        self._pin(key, pinned)
        if current is not None:
            self._retire(current)
        return "loaded" if current is None else "replaced"

    def _pin(self, key: str, pinned: bool) -> None:
        (self.pinned.add if pinned else self.pinned.discard)(key)

    def _retire(self, key: str) -> None:
        """No new request gets this version; its running requests keep it until they end."""
        self.cache.unregister(key)
        self.pinned.discard(key)
        self._forget_if_unused(key)

    def unload(self, name: str) -> None:
        """New requests are refused at once; running ones keep their weights until they finish."""
        if name not in self._current:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        self._retire(self._current.pop(name))

    def list(self) -> dict[str, str]:
        registered = self.cache.registered()
        return {name: registered[key] for name, key in self._current.items()}

    def check_known(self, name: str) -> None:
        if name not in self._current:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded (known: {sorted(self.list())})")

    def current_key(self, name: str) -> str | None:
        """The version a request for `name` admitted now runs on (None: not loaded)."""
        return self._current.get(name)

    def version(self, name: str) -> str:
        self.check_known(name)
        return self._versions[self._current[name]]

    # ---- controller operations -------------------------------------------
    # (by version key: what a request holds once admitted)
    def ensure(self, key: str) -> bool:
        """True when resident in host memory; otherwise a background load is started."""
        if not self.cache.is_registered(key) and not self.cache.is_resident(key):
            raise AdapterNotFoundError(f"adapter {display_name(key)!r} is not loaded (known: {sorted(self.list())})")
        return self.cache.ensure(key)

    def acquire(self, name: str) -> None:
        self.cache.acquire(name)

    def release(self, name: str) -> None:
        self.cache.release(name)
        self._forget_if_unused(name)

    def uses_experts(self, key: str) -> bool:
        """Whether the adapter version (or a name's current one) has expert weights: it needs an expert slot."""
        return self._has_experts.get(self._current.get(key, key), False)

    def assign_slots(self, keys: set[str]) -> tuple[list[tuple[int, str, str, int]], dict[int, int]]:
        """Give every adapter version of the batch a slot, and those with expert weights an expert slot too;
        returns the loads (slot, key, source, load id) and slot -> expert slot of the loads with experts. An
        adapter whose expert slot went to another since it was loaded is loaded again (its slot kept)."""
        loads = dict((key, slot) for slot, key in self.slots.assign(sorted(keys), pinned=self.pinned))
        experts = sorted(key for key in keys if self._has_experts.get(key))
        for _, key in self.expert_slots.assign(experts, pinned=self.pinned):
            loads.setdefault(key, self.slots.slot_of(key))
        expert_slots = {slot: self.expert_slots.slot_of(key) for key, slot in loads.items() if key in experts}
        loads = [(slot, key, self.cache.source(key), self.cache.load_id(key)) for key, slot in loads.items()]
        return loads, expert_slots

    def load_id(self, name: str) -> int:
        """Which read of the adapter's files is resident: part of its KV's prefix-cache identity."""
        return self.cache.load_id(name)

    def forget_slot(self, name: str) -> None:
        """The adapter's slot holds nothing usable (a rank failed to install it): the next batch loads it anew."""
        self.slots.remove(name)
        self.expert_slots.remove(name)

    def slot_of(self, name: str | None) -> int:
        return -1 if name is None else self.slots.slot_of(name)

    def _forget_if_unused(self, key: str) -> None:
        if not self.cache.is_registered(key) and not self.cache.is_resident(key):
            self.slots.remove(key)
            self.expert_slots.remove(key)
            self._versions.pop(key, None)
            self._has_experts.pop(key, None)

    def stats(self) -> dict:
        # versions: which weights each name serves here (content digests), comparable across replicas
        return {"host_cache": self.cache.stats(), "slots": self.slots.stats(),
                "expert_slots": self.expert_slots.stats(),
                "versions": {name: self._versions[key] for name, key in self._current.items()}}

    def prefetch(self, names: list[str], replace: list[str] = ()) -> list[str]:
        """Background loads into host memory of the current versions of `names` not resident (unknown names are
        skipped: the registry may know an adapter this engine has not registered yet). A full cache makes room
        only by evicting the least recently used of `replace` that nothing holds."""
        victims = {self._current[name] for name in replace if name in self._current}
        started = []
        for name in names:
            key = self._current.get(name)
            if key is not None and self.cache.prefetch(key, victims):
                started.append(name)
        return started

    def residency(self) -> dict:
        """Adapter names (not versions) in device slots, in host memory, being loaded, and the one a cold load
        would evict now: what this replica reports to the request router."""
        cache = self.cache.residency()
        victim = cache["evicts_next"]
        return {"device": sorted({display_name(k) for k in self.slots.names()}),
                "host": sorted({display_name(k) for k in cache["host"]}),
                "loading": sorted({display_name(k) for k in cache["loading"]}),
                "evicts_next": display_name(victim) if victim else None}

    def close(self) -> None:
        self.cache.close()
