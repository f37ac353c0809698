"""What the adapter-affinity policy (policy.py) knows: each replica's view, each adapter's demand, the
rendezvous score that orders the replicas for an adapter (also computed by every replica, prefetch.py), and
whether the fleet is short of host cache."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

logger = logging.getLogger("ray.serve")

# What a replica's residency of an adapter costs a request, in queued requests: a host-memory copy
# still needs a slot copy, a load in flight may finish before the request is admitted, a cold one
# reads the adapter from disk first.
RESIDENCY_COST = {"device": 0.0, "host": 0.25, "loading": 0.5, "cold": 1.0}


@dataclass
class ReplicaView:
    """What a replica reported (record_routing_stats), plus what this router sent it since."""
    capacity: int = 1                              # requests it runs at once (the engine's max_num_seqs)
    load: float = 0.0                              # running + waiting requests, as it last reported
    device: frozenset[str] = frozenset()           # adapters in device slots
    host: frozenset[str] = frozenset()             # adapters in host memory
    loading: frozenset[str] = frozenset()          # adapters being read from disk
    evicts_next: str | None = None                 # what a cold load evicts now (its host cache is full)
    lora_budget: int | None = None                 # distinct adapters its steps take (max_loras_per_batch)
    host_slots: int | None = None                  # adapters its host cache holds (max_loaded_loras)
    homes: frozenset[str] = frozenset()            # adapters it is the home of (routing/prefetch.py bounded_homes)
    active: dict[str, int] = field(default_factory=dict)   # adapter -> requests this router has in flight there
    sent_cold: dict[str, float] = field(default_factory=dict)   # adapter -> when sent cold, until reported
    load_avg: float = 0.0                          # load, averaged over the demand half-life (extra homes)
    averaged_at: float = 0.0
    tokens: float = 0.0                            # cold-load budget left
    refilled: float = 0.0                          # when tokens were last refilled

    def residency(self, adapter: str) -> str:
        if adapter in self.device:
            return "device"
        if adapter in self.host:
            return "host"
        if adapter in self.loading or adapter in self.sent_cold:
            return "loading"
        return "cold"


@dataclass
class Demand:
    in_flight: int = 0        # requests routed and not completed
    peak: float = 0.0         # in-flight peak, decayed with demand_half_life_s
    seen: float = 0.0         # when `peak` was last updated
    home: int = 1             # current home-set size
    extra: list[str] = field(default_factory=list)   # homes beyond the claimant, in the order taken
    needed_since: float = 0.0  # when the home set last needed its current size
    routed_at: float = 0.0    # its last request


def rendezvous_order(adapter: str, replica_ids) -> list[str]:
    """The replicas in the adapter's rendezvous order, highest score first."""
    return sorted(replica_ids, key=lambda r: rendezvous_score(adapter, r), reverse=True)


def rendezvous_score(adapter: str, replica_id: str) -> int:
    """Highest-random-weight hashing: the same in every process (Python's hash() is salted)."""
    digest = hashlib.blake2b(f"{adapter}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class CacheShortage:
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
