"""Host-memory LRU cache of loaded adapter versions, and where each is read from.

The engine's step loop calls `ensure` / `acquire` / `release`; loads run in a
background executor and insert on completion, so one lock guards all state and
`load_fn` always runs outside it. Reference counts keep an adapter used by a
running request resident: it is never evicted, and an `unregister` only takes
effect for it at the last `release`.
"""
from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Callable, Collection, Hashable

from lora.adapter import LoRAAdapter
from lora.errors import AdapterError, AdapterLoadTimeoutError, AdapterNotFoundError

# a cached adapter: one version of its weights (lora/ref.py AdapterRef; tests use plain names); str() names it
Key = Hashable
RECENT_LOADS = 64  # latencies kept for stats(); enough for a histogram per scrape
LOAD_THREADS = 4


class HostAdapterCache:
    """LRU of `LoRAAdapter`s, at most `capacity` resident (see `_evict`).

    `load_fn(name, source)` loads and validates one adapter (the engine passes
    a closure over `lora.adapter.load_adapter`); it may pin host memory.
    """

    def __init__(self, capacity: int, load_fn: Callable[[Key, str], LoRAAdapter],
                 executor: concurrent.futures.Executor | None = None, load_timeout_s: float | None = None):
        assert capacity >= 1, capacity
        self.capacity = capacity
        self._load_fn = load_fn
        self.load_timeout_s = load_timeout_s
        self._owns_executor = executor is None
        # A few threads: a load stuck past its timeout (a hung filesystem, the Hub) is given up on, but its
        # thread cannot be stopped; the others keep loading meanwhile.
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(
            max_workers=LOAD_THREADS, thread_name_prefix="lora-load")
        self._lock = threading.Lock()
        self._sources: dict[Key, str] = {}
        self._pinned: set[Key] = set()
        self._resident: collections.OrderedDict[Key, LoRAAdapter] = collections.OrderedDict()
        self._refs: dict[Key, int] = {}
        self._orphans: set[Key] = set()              # unregistered, still referenced
        self._loading: dict[Key, tuple[object, float]] = {}   # name -> (token, start) of the load in flight
        self._failed: dict[Key, AdapterError] = {}   # name -> error of the last background load
        self._evict_first: frozenset[Key] = frozenset()   # see prefer_evicting
        self._counts = dict(hits=0, misses=0, loads=0, evictions=0, load_failures=0)
        self._load_seconds_total = 0.0
        self._recent_load_seconds: collections.deque[float] = collections.deque(maxlen=RECENT_LOADS)

    # -- registry ---------------------------------------------------------

    def register(self, name: Key, source: str, pinned: bool = False) -> None:
        """Make `name` known, or change where it is read from and whether it is pinned. A name is one version
        of an adapter's weights (lora/ref.py): its resident copy, and a running request's, stays valid
        whatever the source, as a page-in from another source is checked to read the same weights."""
        with self._lock:
            self._orphans.discard(name)  # running requests' weights are adopted
            self._failed.pop(name, None)
            self._sources[name] = source
            if pinned:
                self._pinned.add(name)
            else:
                self._pinned.discard(name)

    def unregister(self, name: Key) -> None:
        """Forget `name`; referenced weights stay until their last `release`."""
        with self._lock:
            self._source_of(name)   # not registered: AdapterNotFoundError
            del self._sources[name]
            self._pinned.discard(name)
            self._loading.pop(name, None)
            self._failed.pop(name, None)
            if self._refs.get(name, 0) > 0:
                self._orphans.add(name)
            else:
                self._resident.pop(name, None)

    def is_registered(self, name: Key) -> bool:
        with self._lock:
            return name in self._sources

    # -- loading ----------------------------------------------------------

    def load_now(self, name: Key, preloaded: tuple[LoRAAdapter, float] | None = None) -> LoRAAdapter:
        """Load synchronously (or return the resident copy); load_fn's errors propagate.

        `preloaded`: (adapter, seconds) read already by `read` (off the caller's thread), inserted as is.
        """
        with self._lock:
            source = self._source_of(name)
            if name in self._resident:
                self._resident.move_to_end(name)
                return self._resident[name]
        if preloaded is None:
            preloaded = self._timed_load(name, source)
        with self._lock:
            return self._insert(name, source, *preloaded) or preloaded[0]

    def read(self, name: Key, source: str) -> concurrent.futures.Future:
        """Read and validate `source` on the load threads, without registering it: (adapter, seconds)."""
        return self._executor.submit(self._timed_load, name, source)

    def _timed_load(self, name: Key, source: str) -> tuple[LoRAAdapter, float]:
        """(adapter, seconds) of one `load_fn` call, a failure counted (outside the lock)."""
        start = time.perf_counter()
        try:
            return self._load_fn(name, source), time.perf_counter() - start
        except BaseException:
            with self._lock:
                self._counts["load_failures"] += 1
            raise

    def ensure(self, name: Key) -> bool:
        """True if resident; else start one background load and return False. Raises the error of the last
        failed background load once; the next call retries."""
        with self._lock:
            source = self._source_of(name)
            if name in self._resident:
                self._failed.pop(name, None)
                self._counts["hits"] += 1
                self._resident.move_to_end(name)
                return True
            if name in self._failed:
                raise self._failed.pop(name)
            if name in self._loading:
                token, started = self._loading[name]
                if self.load_timeout_s is None or time.monotonic() - started <= self.load_timeout_s:
                    return False
                del self._loading[name]   # given up on: its result, if it ever comes, is dropped
                self._counts["load_failures"] += 1
                raise AdapterLoadTimeoutError(f"adapter {str(name)!r}: loading took longer than "
                                              f"{self.load_timeout_s:g}s (adapter_load_timeout_s); the next request "
                                              "retries")
            self._counts["misses"] += 1
            token = object()
            self._loading[name] = (token, time.monotonic())
        self._submit(name, source, token)
        return False

    def prefetch(self, name: Key, victims: Collection[Key] = ()) -> bool:
        """Start a background load of a registered adapter neither resident nor loading; True if one started.
        No request asked for it, so it counts no miss. With the cache full it first evicts the least recently
        used of `victims` that nothing holds, and starts nothing if there is none: it never evicts another."""
        with self._lock:
            source = self._sources.get(name)
            if source is None or name in self._resident or name in self._loading:
                return False
            if len(self._resident) + len(self._loading) >= self.capacity:
                victim = next((n for n in self._evictable() if n in victims), None)
                if victim is None:
                    return False
                del self._resident[victim]
                self._counts["evictions"] += 1
            token = object()
            self._loading[name] = (token, time.monotonic())
        self._submit(name, source, token)
        return True

    def _submit(self, name: Key, source: str, token: object) -> None:
        try:
            self._executor.submit(self._load_in_background, name, source, token)
        except BaseException:
            with self._lock:
                if self._loading.get(name, (None,))[0] is token:
                    del self._loading[name]
            raise

    def _load_in_background(self, name: Key, source: str, token: object) -> None:
        start = time.perf_counter()
        try:
            adapter = self._load_fn(name, source)
        except Exception as exc:
            error = exc
            if not isinstance(exc, AdapterError):  # ensure() promises an AdapterError
                error = AdapterError(f"adapter {str(name)!r}: loading {source!r} failed: {exc!r}")
                error.__cause__ = exc
            with self._lock:
                self._counts["load_failures"] += 1
                if self._loading.get(name, (None,))[0] is token:
                    del self._loading[name]
                    self._failed[name] = error
            return
        with self._lock:
            if self._loading.get(name, (None,))[0] is token:
                del self._loading[name]
            # Inserted even if given up on (timed out): it is what the next request asks for anyway.
            self._insert(name, source, adapter, time.perf_counter() - start)

    def _source_of(self, name: Key) -> str:
        if name not in self._sources:
            raise AdapterNotFoundError(f"adapter {str(name)!r}: not registered")
        return self._sources[name]

    def _insert(self, name: Key, source: str, adapter: LoRAAdapter,
                seconds: float) -> LoRAAdapter | None:
        """Count a finished load and insert it (under the lock); None if dropped."""
        self._counts["loads"] += 1
        self._load_seconds_total += seconds
        self._recent_load_seconds.append(seconds)
        if self._sources.get(name) != source:
            return None  # unregistered or re-registered elsewhere while loading
        if name not in self._resident:  # keep a copy already there: it may be referenced
            self._resident[name] = adapter
        self._resident.move_to_end(name)
        self._evict(keep=name)
        return self._resident[name]

    def _evict(self, keep: Key | None = None) -> None:
        """Evict LRU adapters that are unreferenced, unpinned and not `keep`.

        If none is evictable the cache stays over capacity: the controller
        keeps in-use adapters <= max_loras_per_batch <= capacity, so this only
        lasts until running requests release theirs (release re-evicts). Never
        evicting the adapter just inserted stops a load-evict-reload loop.
        """
        while len(self._resident) > self.capacity:
            victim = self._victim(keep)
            if victim is None:
                return
            del self._resident[victim]
            self._counts["evictions"] += 1

    def prefer_evicting(self, names: Collection[Key]) -> None:
        """Copies to lose before others of their age: a replica's copies of adapters it is not the home of
        (routing/prefetch.py), whose requests go to their home unless it is busy, where a home adapter's all come
        here. Only from the older half of the cache: a hot adapter's extra copy is used every few seconds and
        stays young, a spill's ages."""
        with self._lock:
            self._evict_first = frozenset(names)

    def _evictable(self, keep: Key | None = None) -> list[Key]:   # least recently used first
        return [n for n in self._resident if n != keep and n not in self._pinned and self._refs.get(n, 0) == 0]

    def _victim(self, keep: Key | None = None) -> Key | None:
        evictable = self._evictable(keep)
        older = evictable[:max(1, len(evictable) // 2)]
        return next((n for n in older if n in self._evict_first), older[0] if older else None)

    # -- use by running requests -----------------------------------------

    def get(self, name: Key) -> LoRAAdapter | None:
        with self._lock:
            adapter = self._resident.get(name)
            if adapter is not None:
                self._resident.move_to_end(name)
            return adapter

    def acquire(self, name: Key) -> LoRAAdapter:
        with self._lock:
            self._source_of(name)
            if name not in self._resident:
                raise AdapterError(f"adapter {str(name)!r}: not resident in the host cache")
            self._refs[name] = self._refs.get(name, 0) + 1
            self._resident.move_to_end(name)
            return self._resident[name]

    def release(self, name: Key) -> None:
        with self._lock:
            refs = self._refs.get(name, 0)
            if refs <= 0:
                raise RuntimeError(f"adapter {str(name)!r}: release without acquire")
            if refs > 1:
                self._refs[name] = refs - 1
                return
            del self._refs[name]
            if name in self._orphans:
                self._orphans.remove(name)
                self._resident.pop(name, None)
            self._evict()

    def is_resident(self, name: Key) -> bool:
        with self._lock:
            return name in self._resident

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counts, resident=len(self._resident), capacity=self.capacity,
                        registered=len(self._sources), pinned=len(self._pinned), referenced=len(self._refs),
                        loading=len(self._loading), resident_bytes=sum(a.nbytes() for a in self._resident.values()),
                        load_seconds_total=self._load_seconds_total,
                        recent_load_seconds=list(self._recent_load_seconds))

    def residency(self) -> dict:
        """Names in memory (LRU first), being loaded, and what a load would evict now (None: room left)."""
        with self._lock:
            resident = list(self._resident)
            victim = self._victim() if len(resident) >= self.capacity else None
            return {"host": resident, "loading": list(self._loading), "evicts_next": victim}

    def close(self) -> None:
        """Shut down the executor this cache created (an injected one belongs to the caller)."""
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
