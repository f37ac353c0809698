"""The engine's view of adapters: registry + host cache + device slot assignment.

Lives with the controller. Loads happen on a background thread (the host
cache's executor), so the step loop never waits on disk or the Hub.

Versions (as vLLM's adapter ids: a new version is a new id): every load of a name makes an `AdapterRef`
(lora/ref.py) whose version is the content digest of the weights read. The host cache and the slots hold
versions; a request resolves its name to the current version when it is admitted and keeps that version
to its end. Loading a name again with other weights (changed files, another source) makes a new version
that new requests get, beside the old one, which is freed when its last request ends; loading the same
weights again is a no-op (from another source: only where the version is paged in from changes).
"""
from __future__ import annotations

import concurrent.futures
import hashlib

import torch

from lora.adapter import LoRAAdapter, LoRAModelSpec, load_adapter
from lora.names import check_adapter_name
from lora.cache import HostAdapterCache
from lora.errors import AdapterError, AdapterNotFoundError
from lora.modules import EXPERT_MODULES
from lora.ref import AdapterRef
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
        self._current: dict[str, AdapterRef] = {}         # name -> the version new requests get

    @property
    def pinned(self) -> set[AdapterRef]:
        """The versions that keep their slot: current ones loaded with pinned=True."""
        return {ref for ref in self._current.values() if ref.pinned}

    def _load(self, key: AdapterRef | str, source: str) -> LoRAAdapter:
        """Read and validate (the load threads) a name to register, or a version paged back in after eviction,
        which must be the version that was checked: files changed since then are refused, never served in its
        place."""
        adapter = load_adapter(str(key), source, self.spec, max_lora_rank=self.max_lora_rank,
                               adapter_roots=self.adapter_roots or None, allow_hub=self.allow_hub)
        if isinstance(key, AdapterRef) and (got := content_version(adapter)) != key.version:
            raise AdapterError(f"adapter {key.name!r}: its files changed since it was loaded (version {key.version}, "
                               f"the files now hold {got}); load it again to serve the new weights")
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
        its reason and the current version stays. Returns "loaded", "replaced" (a new version, or the same weights
        from another source: new requests get it, running ones finish on theirs) or "unchanged" (the same source
        and weights: nothing to do but the pin)."""
        check_adapter_name(name)
        current = self._current.get(name)
        was_pinned = current is not None and current.pinned
        pinned_refs = self.pinned - {current}
        if pinned and not was_pinned and len(pinned_refs) + 1 >= self.max_loras_per_batch:
            raise AdapterError(f"adapter {name!r}: pinning it would leave no free slot "
                               f"(max_loras_per_batch={self.max_loras_per_batch})")
        adapter = preloaded[0] if preloaded is not None else self._load(name, source)
        has_experts = any(module in EXPERT_MODULES for _, module in adapter.weights)
        if pinned and has_experts and not was_pinned and \
                sum(map(self.uses_experts, pinned_refs)) + 1 >= self.max_expert_loras:
            raise AdapterError(f"adapter {name!r}: pinning it would leave no free expert slot "
                               f"(max_expert_loras={self.max_expert_loras})")
        ref = AdapterRef(name, content_version(adapter), source, pinned, has_experts)
        self.cache.register(ref, source, pinned=pinned)   # the same version again: only its source or pin change
        if ref != current:
            try:
                self.cache.load_now(ref, preloaded or (adapter, 0.0))
            except Exception:
                self.cache.unregister(ref)
                self._forget_if_unused(ref)
                raise
        self._current[name] = ref
        if current is None:
            return "loaded"
        if ref != current:
            self._retire(current)
            return "replaced"
        return "unchanged" if source == current.source else "replaced"

    def _retire(self, ref: AdapterRef) -> None:
        """No new request gets this version; its running requests keep it until they end."""
        self.cache.unregister(ref)
        self._forget_if_unused(ref)

    def unload(self, name: str) -> None:
        """New requests are refused at once; running ones keep their weights until they finish."""
        if name not in self._current:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        self._retire(self._current.pop(name))

    def list(self) -> dict[str, str]:
        return {name: ref.source for name, ref in self._current.items()}

    def check_known(self, name: str) -> None:
        if name not in self._current:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded (known: {sorted(self.list())})")

    def current(self, name: str) -> AdapterRef | None:
        """The version a request for `name` admitted now runs on (None: not loaded)."""
        return self._current.get(name)

    def version(self, name: str) -> str:
        self.check_known(name)
        return self._current[name].version

    # ---- controller operations -------------------------------------------
    # (by version: what a request holds once admitted; a name where its request waits for an unloaded one)
    def ensure(self, ref: AdapterRef | str) -> bool:
        """True when resident in host memory; otherwise a background load is started."""
        if not self.cache.is_registered(ref) and not self.cache.is_resident(ref):
            raise AdapterNotFoundError(f"adapter {str(ref)!r} is not loaded (known: {sorted(self.list())})")
        return self.cache.ensure(ref)

    def acquire(self, ref: AdapterRef) -> None:
        self.cache.acquire(ref)

    def acquire_current(self, name: str) -> AdapterRef | None:
        """A reference to the current version of `name` if it is in host memory (None: not yet, a load
        starts); the request that asked keeps that version to its end. AdapterError: unloaded, or its load
        failed."""
        ref = self.current(name)
        if ref is None:
            self.check_known(name)   # unloaded while its request waited: AdapterNotFoundError
        if not self.ensure(ref):
            return None
        try:
            self.acquire(ref)
        except AdapterError:   # evicted by a load that finished in between: retry next step
            return None
        return ref

    def release(self, ref: AdapterRef) -> None:
        self.cache.release(ref)
        self._forget_if_unused(ref)

    def uses_experts(self, key: AdapterRef | str) -> bool:
        """Whether the adapter version (or a name's current one) has expert weights: it needs an expert slot."""
        ref = self._current.get(key, key)
        return isinstance(ref, AdapterRef) and ref.has_experts

    def assign_slots(self, refs: set[AdapterRef]) -> tuple[list[tuple[int, AdapterRef]], dict[int, int]]:
        """Give every adapter version of the batch a slot, and those with expert weights an expert slot too;
        returns the loads (slot, version) and slot -> expert slot of the loads with experts. An adapter whose
        expert slot went to another since it was loaded is loaded again (its slot kept)."""
        pinned = self.pinned
        loads = dict((ref, slot) for slot, ref in self.slots.assign(sorted(refs), pinned=pinned))
        experts = sorted(ref for ref in refs if ref.has_experts)
        for _, ref in self.expert_slots.assign(experts, pinned=pinned):
            loads.setdefault(ref, self.slots.slot_of(ref))
        expert_slots = {slot: self.expert_slots.slot_of(ref) for ref, slot in loads.items() if ref in experts}
        return [(slot, ref) for ref, slot in loads.items()], expert_slots

    def forget_slot(self, ref: AdapterRef) -> None:
        """The adapter's slot holds nothing usable (a rank failed to install it): the next batch loads it anew."""
        self.slots.remove(ref)
        self.expert_slots.remove(ref)

    def slot_of(self, ref: AdapterRef | None) -> int:
        return -1 if ref is None else self.slots.slot_of(ref)

    def _forget_if_unused(self, ref: AdapterRef) -> None:
        if not self.cache.is_registered(ref) and not self.cache.is_resident(ref):
            self.slots.remove(ref)
            self.expert_slots.remove(ref)

    def stats(self) -> dict:
        # versions: which weights each name serves here (content digests), comparable across replicas
        return {"host_cache": self.cache.stats(), "slots": self.slots.stats(),
                "expert_slots": self.expert_slots.stats(),
                "versions": {name: ref.version for name, ref in self._current.items()}}

    def prefetch(self, names: list[str], replace: list[str] = ()) -> list[str]:
        """Background loads into host memory of the current versions of `names` not resident (unknown names are
        skipped: the registry may know an adapter this engine has not registered yet). A full cache makes room
        only by evicting the least recently used of `replace` that nothing holds; a request's load, later, evicts
        those first too (HostAdapterCache.prefer_evicting)."""
        victims = {self._current[name] for name in replace if name in self._current}
        self.cache.prefer_evicting(victims)   # a request's load too loses these first
        started = []
        for name in names:
            ref = self._current.get(name)
            if ref is not None and self.cache.prefetch(ref, victims):
                started.append(name)
        return started

    def residency(self) -> dict:
        """Adapter names (not versions) in device slots, in host memory, being loaded, and the one a cold load
        would evict now: what this replica reports to the request router."""
        cache = self.cache.residency()
        victim = cache["evicts_next"]
        return {"device": sorted({ref.name for ref in self.slots.names()}),
                "host": sorted({ref.name for ref in cache["host"]}),
                "loading": sorted({ref.name for ref in cache["loading"]}),
                "evicts_next": victim.name if victim else None}

    def close(self) -> None:
        self.cache.close()
