"""Whether a fleet is short of host cache, for the adapter-affinity policy (policy.py `rank`).

A fleet whose live adapters (routed in the last live_s) fill more than `ratio` of its replicas' host slots is
short of cache: a second copy of an adapter then evicts one that is live, and its next request reads it again
(benchmarks/fleet.py's 4 replicas x 48 slots for 160-178 live adapters, replayed in the simulation: a cold spill
cost about 1.6 misses). There an adapter spreads early, at short_home_share (more homes, so warm ones), and a home
takes up to short_cold_spill_factor x the mean load before a request spills cold; the policy also grows a home set
only while each of its homes is at the bounded-load limit, and prefers a home that holds the adapter (`short`).
"""
from __future__ import annotations

import logging

logger = logging.getLogger("ray.serve")


class CacheShortage:
    def __init__(self, ratio: float | None, live_s: float, normal: tuple[float, float], short: tuple[float, float]):
        self.ratio, self.live_s, self.normal, self.short_knobs = ratio, live_s, normal, short
        self.short, self._at = False, float("-inf")

    def knobs(self, now: float, replicas: dict, demand: dict) -> tuple[float, float]:
        """(home_share, cold_spill_factor) now, from the replicas' reported host slots and the adapters' demand."""
        # counted once a second: the router's dict holds every adapter it saw
        if self.ratio is not None and now - self._at >= 1.0:
            slots = [v.host_slots for v in replicas.values()]
            live = sum(now - d.routed_at < self.live_s for d in demand.values())
            short = None not in slots and live > self.ratio * sum(slots)
            if short != self.short:   # in the Serve logs of the process this router runs in
                logger.info("adapter-affinity routing: %d adapters live, %s host slots in the fleet: %s",
                            live, sum(slots) if None not in slots else "unreported",
                            "short of host cache (home_share %g, cold_spill_factor %g)" % self.short_knobs
                            if short else "back to home_share %g, cold_spill_factor %g" % self.normal)
            self.short, self._at = short, now
        return self.short_knobs if self.short else self.normal
