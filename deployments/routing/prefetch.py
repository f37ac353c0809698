"""Each replica reads into host memory, ahead of any request, the adapters it is the home of.

The router sends an adapter first to the head of its rendezvous order over the live replicas
(policy.py); every replica can compute that order too, from the registry's adapters and its list of
live replicas (their heartbeats). So each replica prefetches its share of the adapters while its host
cache has room, and the fleet's host memory holds the adapter set once, partitioned, instead of
each replica holding whatever its first requests asked for. A replica that joins takes over its
share before traffic reaches it; when one leaves, the next in each of its adapters' orders loads them.

Prefetch only fills room (up to `fill` of the cache): it never evicts, so an adapter that requests
brought in is never pushed out by one that nobody has asked for.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from deployments.routing.policy import rendezvous_score

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
        self.engine, self.room = engine, int(capacity * fill)
        self.period_s = period_s

    async def step(self) -> list[str]:
        """Start loading the home adapters that fit in the room left; returns their names."""
        live = set(await self._live_replicas()) | {self.replica_id}
        homes = sorted(a for a in self._adapters() if home_of(a, sorted(live)) == self.replica_id)
        residency = (await self.engine.stats()).get("lora", {}).get("residency", {})
        held = set(residency.get("host", ())) | set(residency.get("loading", ()))
        wanted = [a for a in homes if a not in held][:max(0, self.room - len(held))]
        new = [a for a in wanted if a not in self._registered()]
        for name in new:
            await self._register(name)   # reads it now (an adapter hot-loaded after this replica started)
        return new + await self.engine.prefetch_adapters([a for a in wanted if a not in new])

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:   # noqa: BLE001  (a registry restart, an adapter whose files went: next period)
                logger.debug("replica %s: adapter prefetch failed", self.replica_id, exc_info=True)
            await asyncio.sleep(self.period_s)
