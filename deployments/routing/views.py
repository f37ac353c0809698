"""What the adapter-affinity policy (policy.py) knows: each replica's view, each adapter's demand, and the
rendezvous score that orders the replicas for an adapter (also computed by every replica, prefetch.py)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

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
