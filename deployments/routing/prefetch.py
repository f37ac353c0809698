"""Each replica reads into host memory, ahead of any request, the adapters it is the home of.

Every replica computes the same homes from the registry's adapters and its list of live replicas (their
heartbeats): `bounded_homes`, rendezvous order with at most an even share of the adapters per replica, and
reports its own to the routers (record_routing_stats), which send an adapter to its home first (policy.py).
So each replica prefetches its share of the adapters while its host cache has room, and the fleet's host
memory holds the adapter set once, partitioned, instead of each replica holding whatever its first requests
asked for. A replica that joins takes over its share before traffic reaches it; when one leaves, the next in
each of its adapters' orders loads them.

Prefetch keeps up to `fill` of the cache in home adapters: it fills free room, and beyond that evicts only
adapters this replica is not the home of (least recently used first, none that a step holds): at start
every replica has read every configured adapter to validate it, and its cache holds whichever came last.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from deployments.routing.views import rendezvous_order, rendezvous_score

logger = logging.getLogger("ray.serve")


def bounded_homes(adapters: list[str], replica_ids: list[str]) -> dict[str, str]:
    """adapter -> its home: the first replica of its rendezvous order with fewer than ceil(adapters / replicas)
    homes, the adapters taken in a fixed hash order (consistent hashing with bounded loads, Mirrokni et al.
    2018). Plain rendezvous gives each replica a binomial share: 4 replicas x 200 adapters drew 39 to 64 homes
    for 48 host slots (benchmarks/fleet.py), so one replica's home adapters evicted each other while another's
    cache had room. A function of the two sets only, so every replica computes the same homes; a replica that
    joins or leaves still moves few adapters (those it heads, and the few a full replica passes on)."""
    if not replica_ids:
        return {}
    cap = -(-len(adapters) // len(replica_ids))
    count = dict.fromkeys(replica_ids, 0)
    homes = {}
    for adapter in sorted(set(adapters), key=lambda a: rendezvous_score(a, "")):
        home = next(r for r in rendezvous_order(adapter, replica_ids) if count[r] < cap)
        count[home] += 1
        homes[adapter] = home
    return homes


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
        self.homes: list[str] = []      # this replica's home adapters: reported to the routers (record_routing_stats)
        self._placed: tuple = ((), ())  # (adapters, live replicas) that `homes` was computed for

    async def step(self) -> list[str]:
        """Start loading the home adapters not held, up to `fill` of the cache in home adapters; returns them."""
        live = tuple(sorted(set(await self._live_replicas()) | {self.replica_id}))
        adapters = tuple(sorted(self._adapters()))
        if (adapters, live) != self._placed:
            placed = await asyncio.to_thread(bounded_homes, list(adapters), list(live))   # ~1 s at 10k x 64
            self.homes = sorted(a for a, r in placed.items() if r == self.replica_id)
            self._placed = (adapters, live)
        homes = self.homes
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
