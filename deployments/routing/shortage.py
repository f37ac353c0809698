"""Whether a fleet is short of host cache, for the adapter-affinity policy (policy.py `rank`).

A fleet whose live adapters (routed in the last live_s) fill more than `ratio` of its replicas' host slots is
short of cache: a second copy of an adapter then evicts one that is live, and its next request reads it again
(benchmarks/fleet.py's 4 replicas x 48 slots for 160-178 live adapters, replayed in the simulation: a cold spill
cost about 1.6 misses). There an adapter spreads early, at short_home_share (more homes, so warm ones), and a home
takes more than cold_spill_factor x the mean load before a request spills cold: up to short_cold_spill_factor x
when every slot holds a live adapter, in proportion between (with 64 slots a replica, 70 % of them live, a factor of
3 let a hot adapter's homes hold 1.8-2.0x the mean load at 28 req/s; 1.5, about 1.3 there, kept the hit rate at
0.96 with imbalance 1.20-1.29; benchmarks/RESULTS.md "sixteenth session"); the policy also grows a home set only
while each of its homes is at the bounded-load limit, and prefers a home that holds the adapter (`short`).
"""
from __future__ import annotations

import logging

logger = logging.getLogger("ray.serve")


class CacheShortage:
    def __init__(self, ratio: float | None, live_s: float, normal: tuple[float, float], short: tuple[float, float]):
        self.ratio, self.live_s, self.normal, self.short_knobs = ratio, live_s, normal, short
        self.short, self._at, self._short_now = False, float("-inf"), short

    def knobs(self, now: float, replicas: dict, demand: dict) -> tuple[float, float]:
        """(home_share, cold_spill_factor) now, from the replicas' reported host slots and the adapters' demand."""
        # counted once a second: the router's dict holds every adapter it saw
        if self.ratio is not None and now - self._at >= 1.0:
            slots = [v.host_slots for v in replicas.values()]
            live = sum(now - d.routed_at < self.live_s for d in demand.values())
            fullness = live / sum(slots) if None not in slots and sum(slots) else 0.0
            short = fullness > self.ratio
            if short:   # how far from `ratio` to every slot live: the cold spill factor goes from normal to short
                depth = min(1.0, (fullness - self.ratio) / (1 - self.ratio)) if self.ratio < 1 else 1.0
                (_, spill), (short_share, short_spill) = self.normal, self.short_knobs
                self._short_now = (short_share, spill + depth * (short_spill - spill))
            if short != self.short:   # in the Serve logs of the process this router runs in
                logger.info("adapter-affinity routing: %d adapters live, %s host slots in the fleet: %s",
                            live, sum(slots) if None not in slots else "unreported",
                            "short of host cache (home_share %g, cold_spill_factor %.2g)" % self._short_now
                            if short else "back to home_share %g, cold_spill_factor %g" % self.normal)
            self.short, self._at = short, now
        return self._short_now if self.short else self.normal
