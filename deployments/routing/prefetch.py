"""Each replica reads into host memory, ahead of any request, the adapters it is the home of.

The router sends an adapter first to the head of its rendezvous order over the live replicas
(policy.py); every replica can compute that order too, from the registry's adapters and its list of
live replicas (their heartbeats). So each replica prefetches its share of the adapters while its host
cache has room, and the fleet's host memory holds the adapter set once, partitioned, instead of
each replica holding whatever its first requests asked for. A replica that joins takes over its
share before traffic reaches it; when one leaves, the next in each of its adapters' orders loads them.

Prefetch keeps up to `fill` of the cache in home adapters: it fills free room, and beyond that evicts only
adapters this replica is not the home of (least recently used first, none that a step holds): at start
every replica has read every configured adapter to validate it, and its cache holds whichever came last.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from deployments.routing.views import rendezvous_score

logger = logging.getLogger("ray.serve")


def home_of(adapter: str, replica_ids: list[str]) -> str:
    return max(replica_ids, key=lambda r: rendezvous_score(adapter, r))


class HomePrefetcher:
    def __init__(self, replica_id: str, *, live_replicas: Callable[[], Awaitable[list[str]]],
                 adapters: Callable[[], dict[str, str]], registered: Callable[[], dict[str, str]],
                 register: Callable[[str], Awaitable], engine, capacity: int, fill: float = 0.75,
                 period_s: float = 1.0):
        self.replica_id = replica_id
        self._live_replicas, self._adapters, self._registered, self._register = (live_replicas, adapters,
                                                                                 registered, register)
        self.engine, self.capacity, self.room = engine, capacity, int(capacity * fill)
        self.period_s = period_s

    async def step(self) -> list[str]:
        """Start loading the home adapters not held, up to `fill` of the cache in home adapters; returns them."""
        live = set(await self._live_replicas()) | {self.replica_id}
        homes = sorted(a for a in self._adapters() if home_of(a, sorted(live)) == self.replica_id)
        residency = (await self.engine.stats()).get("lora", {}).get("residency", {})
        held = set(residency.get("host", ())) | set(residency.get("loading", ()))
        home_set = set(homes)
        wanted = [a for a in homes if a not in held][:max(0, self.room - len(held & home_set))]
        # room beyond the free slots is made only from adapters this replica is not the home of and no step
        # holds (the least recently used first): a warm copy of another replica's adapter goes before a home one
        others = [a for a in held if a not in home_set and a not in residency.get("device", ())]
        unregistered = [a for a in wanted if a not in self._registered()]
        new = unregistered[:max(0, self.capacity - len(held))]   # registering reads it: only into free room
        for name in new:
            await self._register(name)   # an adapter hot-loaded after this replica started
        cached = [a for a in wanted if a not in unregistered]
        return new + await self.engine.prefetch_adapters(cached, others)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:   # noqa: BLE001  (a registry restart, an adapter whose files went: next period)
                logger.debug("replica %s: adapter prefetch failed", self.replica_id, exc_info=True)
            await asyncio.sleep(self.period_s)
