"""Adapter-affinity placement: which replicas a request for an adapter should go to, best first.

Pure Python (no Ray): the Serve router (deployments/routing/router.py) and benchmarks/fleet_sim.py drive it.

- Every adapter has a home set of `k` replicas: the head of its rendezvous (highest-random-weight) order
  over the live replicas (or the replica reporting it among its even share of homes, prefetch.py), then
  extra homes taken as it heated, each the less loaded of the next two in that order. The replicas' host
  caches then partition the adapters, and a replica joining or leaving moves only the adapters it heads.
- `k` follows the adapter's demand (its peak in-flight requests, decayed): ceil(demand / (home_share *
  replica capacity)), at least 1, at most max_home; it grows at once and shrinks one step per cool-down.
- Inside the home set the least cost wins: in-flight requests plus a residency penalty (device slot < host
  memory < loading < cold). One at or over the bounded-load limit (load_factor x the mean load with this
  request, as consistent hashing with bounded loads) is passed over; the request spills to the next
  replica in hash order, before any replica rejects it; to a replica that must read it cold only past the
  cold bound (cold_spill_factor x the mean load, and at least cold_spill_margin requests past the bound).
- Cold loads cost each replica a token of a bucket (cold_loads_per_s, burst cold_burst): a burst of
  cold adapters goes to replicas with tokens left, so it cannot flush one replica's hot adapters. A
  replica whose host cache would evict the last resident copy of an adapter that still has traffic
  is passed over for a cold load (the last-copy rule).
- A fleet short of host cache (views.py `CacheShortage`) spreads hot adapters earlier and stretches a home further, but
  grows a home set only when each of its homes is at the limit, and a warm home beats a cold one there.
- Base-model requests (no adapter) go to the least-loaded replica.

Nothing is refused here: the ranking lists every live replica (the rules only order them), except in a saturated
fleet (a queue of half a batch everywhere): no cold replica is listed, no home set grows; Serve retries the others.
"""
from __future__ import annotations

import math
import random
import time
from typing import Callable, Iterable

from deployments.routing.views import RESIDENCY_COST, CacheShortage, Demand, ReplicaView, rendezvous_order

ORDER_CACHE_SIZE = 1 << 16   # adapters whose hash order is kept (recomputed when the replicas change)
SATURATED = 1.5              # mean load / a replica's capacity (max_num_seqs) past which the fleet is saturated


class AffinityPolicy:
    def __init__(self, *, home_share: float = 0.5, load_factor: float = 1.05, cold_spill_factor: float = 1.15,
                 cold_spill_margin: int = 2, min_spill_load: int | None = None, max_home: int | None = None,
                 cooldown_s: float = 30.0, demand_half_life_s: float = 10.0,
                 cold_loads_per_s: float = 2.0, cold_burst: float = 4.0, sent_cold_ttl_s: float = 5.0,
                 short_cache_ratio: float | None = 0.5, short_home_share: float = 0.25,
                 short_cold_spill_factor: float = 1.5, live_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None):
        if not 0 < home_share <= 1:
            raise ValueError(f"home_share must be in (0, 1], got {home_share!r}")
        if not 1 <= load_factor <= cold_spill_factor:
            raise ValueError(f"need 1 <= load_factor <= cold_spill_factor, got {load_factor!r} and "
                             f"{cold_spill_factor!r}")
        if short_cache_ratio is not None and short_cache_ratio <= 0:   # None: never short
            raise ValueError(f"short_cache_ratio must be > 0 or None, got {short_cache_ratio!r}")
        if not 0 < short_home_share <= 1 or short_cold_spill_factor < 1 or live_s <= 0:
            raise ValueError(f"need 0 < short_home_share <= 1, short_cold_spill_factor >= 1 and live_s > 0, got "
                             f"{short_home_share!r}, {short_cold_spill_factor!r} and {live_s!r}")
        if max_home is not None and max_home < 1 or cold_spill_margin < 0:
            raise ValueError(f"need max_home >= 1 or None and cold_spill_margin >= 0, got {max_home!r} and "
                             f"{cold_spill_margin!r}")
        self.home_share, self.min_spill_load, self.cold_spill_margin = home_share, min_spill_load, cold_spill_margin
        self.load_factor, self.cold_spill_factor = load_factor, cold_spill_factor
        self.max_home, self.cooldown_s, self.half_life_s = max_home, cooldown_s, demand_half_life_s
        self.cold_rate, self.cold_burst, self.sent_cold_ttl_s = cold_loads_per_s, cold_burst, sent_cold_ttl_s
        self.short_knobs = (min(home_share, short_home_share), max(cold_spill_factor, short_cold_spill_factor))
        self.shortage = CacheShortage(short_cache_ratio, live_s, (home_share, cold_spill_factor), self.short_knobs)
        self.clock, self.rng = clock, rng or random.Random()
        self.replicas: dict[str, ReplicaView] = {}
        self.in_flight: dict[str, int] = {}       # replica -> requests this router sent and not completed
        self.demand: dict[str, Demand] = {}
        self._orders: dict[str, list[str]] = {}

    # ---- what the fleet looks like ---------------------------------------------------------------
    def set_replicas(self, replica_ids: Iterable[str]) -> None:
        ids = set(replica_ids)
        if ids == set(self.replicas):
            return
        now = self.clock()
        for gone in set(self.replicas) - ids:
            del self.replicas[gone]
            self.in_flight.pop(gone, None)
        for new in ids - set(self.replicas):
            self.replicas[new] = ReplicaView(tokens=self.cold_burst, refilled=now, averaged_at=now)
            self.in_flight.setdefault(new, 0)
        self._orders.clear()

    def report(self, replica_id: str, *, capacity: int | None = None, load: float | None = None,
               device: Iterable[str] = (), host: Iterable[str] = (), loading: Iterable[str] = (),
               evicts_next: str | None = None, lora_budget: int | None = None,
               host_slots: int | None = None, homes: Iterable[str] | None = None) -> None:
        """A replica's routing stats. Adapters it now reports resident are no longer 'sent cold'."""
        view = self.replicas.get(replica_id)
        if view is None:
            return
        if homes is not None and frozenset(homes) != view.homes:
            view.homes = frozenset(homes)
            self._orders.clear()
        view.capacity = max(1, int(capacity)) if capacity else view.capacity
        view.load = float(load) if load is not None else view.load
        now = self.clock()
        weight = 1 - 0.5 ** (max(0.0, now - view.averaged_at) / self.half_life_s) if self.half_life_s > 0 else 1.0
        view.load_avg += weight * (self.load(replica_id) - view.load_avg)
        view.averaged_at = now
        view.device, view.host, view.loading = frozenset(device), frozenset(host), frozenset(loading)
        view.evicts_next = evicts_next
        view.lora_budget = lora_budget if lora_budget else view.lora_budget
        view.host_slots = host_slots if host_slots else view.host_slots
        view.sent_cold = {a: t for a, t in view.sent_cold.items()
                          if a not in view.device and a not in view.host and a not in view.loading
                          and now - t < self.sent_cold_ttl_s}

    def load(self, replica_id: str) -> float:
        """This router's own count is exact for what it sent; a replica's report also counts what other
        routers (other proxies, handles) sent it, a second late."""
        return max(float(self.in_flight.get(replica_id, 0)), self.replicas[replica_id].load)

    # ---- ranking -------------------------------------------------------------------------------------
    def rank(self, adapter: str | None) -> list[str]:
        """The live replicas, best first, for one request of `adapter` (None: the base model): every one of them
        unless the fleet is saturated (then no cold one)."""
        if not self.replicas:
            return []
        loads = {r: self.load(r) for r in self.replicas}
        if adapter is None:
            return sorted(loads, key=lambda r: (loads[r], self.rng.random()))
        now = self.clock()
        order = self.order(adapter)
        mean = (sum(loads.values()) + 1) / len(loads)
        home_share, cold_spill_factor = self.shortage.knobs(now, self.replicas, self.demand)   # short_* when short
        bound = max(self._spill_floor(), math.ceil(self.load_factor * mean))
        # short of cache a copy evicts a live adapter: a home set grows only when each of its homes is at the bound,
        # and a home that holds the adapter beats a cold one below it (with room to spare, neither: in benchmarks/
        # fleet_sim.py's 64 x 10,000 drift phase the growth rule took imbalance to 1.25, warm-first TTFT p99 to 2.8 s)
        short = self.shortage.short
        d = self.demand.get(adapter)
        crowded = d is None or not short or min(loads[r] for r in self.home_set(adapter, order, d.home)) >= bound
        k = self.home_size(adapter, now, mean, home_share, grow=crowded)
        home = self.home_set(adapter, order, k)
        home_set = set(home)
        others = [r for r in order if r not in home_set]
        # at a few requests in flight both factors round to one bound (mean 2.6: 3); a cold read waits for a margin
        cold_bound = max(bound + self.cold_spill_margin, math.ceil(cold_spill_factor * mean))

        def warm(r: str) -> bool:
            return self.replicas[r].residency(adapter) != "cold"

        def cost(r: str) -> tuple[bool, float]:
            return short and not warm(r), loads[r] + RESIDENCY_COST[self.replicas[r].residency(adapter)]
        open_home = sorted((r for r in home if loads[r] < bound), key=cost)
        warm_spill = [r for r in others if loads[r] < bound and warm(r)]
        # past `bound` a home takes more before the request spills to a replica that must read the adapter cold
        stretched = sorted((r for r in home if bound <= loads[r] < cold_bound), key=cost)
        # saturated: a cold copy adds a read and an eviction, not capacity (34 req/s on 4 replicas of 0.25 cores:
        # hit rate 0.82, RESULTS.md "fourteenth session"); the home set and warm copies wait (Serve retries)
        saturated = self._saturated(mean)
        cold_spill = [] if saturated else self._cold_order(
            [r for r in others if loads[r] < bound and not warm(r)], now)
        if open_home and not self._may_serve(adapter, open_home[0], now):   # out of cold budget: a copy first
            open_home, warm_spill = warm_spill + open_home, []
        # A replica whose steps already hold its LoRA budget of other adapters queues the request until a whole
        # generation ends there: another copy that admits it now goes first (order kept otherwise); a cold
        # replica does not (its read, and the copy it evicts, cost more than the wait on average)
        ranked = sorted(open_home + warm_spill + stretched + cold_spill, key=lambda r: 0 if self._admits_now(
            adapter, r) and (r in home_set or warm(r)) else 1 if r in home_set else 2)
        chosen = set(ranked)
        rest = sorted((r for r in order if r not in chosen), key=lambda r: loads[r])
        if saturated:
            rest = [r for r in rest if r in home_set or warm(r)]
        return ranked + rest

    def _admits_now(self, adapter: str, replica_id: str) -> bool:
        view = self.replicas[replica_id]
        return view.lora_budget is None or adapter in view.active or len(view.active) < view.lora_budget

    def _cold_order(self, cold: list[str], now: float) -> list[str]:
        """Cold spill candidates in hash order, those that may not load cold now (no cold-load token left, or the
        load would evict a last copy) behind the others."""
        allowed = [r for r in cold if self._may_load_cold(r, now)]
        return allowed + [r for r in cold if r not in allowed]

    def _may_serve(self, adapter: str, replica_id: str, now: float) -> bool:
        return self.replicas[replica_id].residency(adapter) != "cold" or self._may_load_cold(replica_id, now)

    def _may_load_cold(self, replica_id: str, now: float) -> bool:
        view = self.replicas[replica_id]
        self._refill(view, now)
        return view.tokens >= 1 and not self._is_last_copy(view.evicts_next, replica_id)

    def _is_last_copy(self, adapter: str | None, replica_id: str) -> bool:
        """`adapter` has traffic and `replica_id` holds its only resident copy."""
        if adapter is None or self._demand_now(adapter) <= 0:
            return False
        return not any(other != replica_id and v.residency(adapter) != "cold"
                       for other, v in self.replicas.items())

    def _refill(self, view: ReplicaView, now: float) -> None:
        view.tokens = min(self.cold_burst, view.tokens + (now - view.refilled) * self.cold_rate)
        view.refilled = now

    def order(self, adapter: str) -> list[str]:
        """The live replicas in the adapter's rendezvous order (highest score first), the replica that reports
        it among its homes (an even share each, prefetch.py `bounded_homes`) moved to the front."""
        order = self._orders.get(adapter)
        if order is None:
            if len(self._orders) >= ORDER_CACHE_SIZE:
                self._orders.clear()
            order = rendezvous_order(adapter, self.replicas)
            # while replicas disagree (one of them has not seen a change yet) the first claimant in hash order
            claimant = next((r for r in order if adapter in self.replicas[r].homes), None)
            order.sort(key=lambda r: r != claimant)   # stable: the others keep their order
            self._orders[adapter] = order
        return order

    def _capacity(self) -> float:
        return sum(v.capacity for v in self.replicas.values()) / len(self.replicas)

    def _saturated(self, mean_load: float) -> bool:
        return mean_load >= SATURATED * self._capacity()

    def _spill_floor(self) -> int:
        """Below this a home never spills: a step's cost hardly grows with its first few sequences, and a spill
        of a rarely used adapter is a cold read and a second copy (default: a quarter of a replica's capacity)."""
        return self.min_spill_load if self.min_spill_load is not None else max(1, math.ceil(self._capacity() / 4))

    def home_size(self, adapter: str, now: float | None = None, mean_load: float | None = None,
                  home_share: float | None = None, grow: bool = True) -> int:
        """An adapter's home grows to carry its demand at `home_share` of a replica's fair share of the load (the
        mean load, at least the spill floor, at most the replica's capacity): a hot adapter spreads at any load
        (`grow` False: not now), the tail stays at home (one request in flight is never a reason for a second home)."""
        now = self.clock() if now is None else now
        d = self.demand.setdefault(adapter, Demand(seen=now, needed_since=now))
        if mean_load is None:
            mean_load = (sum(self.load(r) for r in self.replicas) + 1) / len(self.replicas)
        share = max(1.0, (home_share or self.home_share) * min(self._capacity(), max(self._spill_floor(), mean_load)))
        limit = min(self.max_home or len(self.replicas), len(self.replicas))
        needed = min(limit, max(1, math.ceil(self._demand_now(adapter, now) / share)))
        if self._saturated(mean_load) or not grow:   # queued requests inflate demand, a home adds nothing
            needed = min(needed, d.home)
        if needed >= d.home:
            d.home, d.needed_since = needed, now
        elif now - d.needed_since >= self.cooldown_s:   # one step per cool-down: no flapping
            d.home, d.needed_since = d.home - 1, now
        d.home = min(d.home, limit)
        return d.home

    def home_set(self, adapter: str, order: list[str], k: int) -> list[str]:
        """The claimant (the head of `order`), then the extra homes the adapter took as it heated, each the less
        loaded on average of the next two in hash order when taken, kept while the set lasts. (The next one alone was as
        often a loaded replica as not: 4 x 200 adapters at Zipf 1.0 give the homes 0.13-0.37 of the traffic.)"""
        d, k = self.demand[adapter], min(k, len(order))   # a set of every replica outlives one leaving
        extra = [r for r in d.extra if r in self.replicas and r != order[0]][:k - 1]
        while len(extra) < k - 1:
            taken = {order[0], *extra}
            free = [r for r in order if r not in taken][:2]   # of two: the least loaded of all herded (64 replicas)
            extra.append(min(free, key=lambda r: self.replicas[r].load_avg))
        d.extra = extra
        return [order[0], *extra]

    def _demand_now(self, adapter: str, now: float | None = None) -> float:
        d = self.demand.get(adapter)
        if d is None:
            return 0.0
        now = self.clock() if now is None else now
        decayed = d.peak * 0.5 ** ((now - d.seen) / self.half_life_s) if self.half_life_s > 0 else 0.0
        d.peak, d.seen = max(float(d.in_flight), decayed), now
        return d.peak

    # ---- what this router did ------------------------------------------------------------------------
    def routed(self, adapter: str | None, replica_id: str) -> None:
        """A request was accepted by `replica_id`: count it, and spend a cold-load token if it loads cold."""
        if replica_id not in self.replicas:
            return
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        if adapter is None:
            return
        now = self.clock()
        d = self.demand.setdefault(adapter, Demand(seen=now, needed_since=now))
        d.in_flight += 1
        d.routed_at = now
        self._demand_now(adapter, now)
        view = self.replicas[replica_id]
        view.active[adapter] = view.active.get(adapter, 0) + 1
        if view.residency(adapter) == "cold":
            self._refill(view, now)
            view.tokens -= 1          # may go negative: a request is never refused, the debt delays others
            view.sent_cold[adapter] = now

    def completed(self, adapter: str | None, replica_id: str) -> None:
        if replica_id in self.in_flight:
            self.in_flight[replica_id] = max(0, self.in_flight[replica_id] - 1)
        view = self.replicas.get(replica_id)
        if view is not None and adapter in view.active:
            view.active[adapter] -= 1
            if not view.active[adapter]:
                del view.active[adapter]
        d = self.demand.get(adapter) if adapter is not None else None
        if d is not None:
            self._demand_now(adapter)   # the peak keeps what it was before this request ended
            d.in_flight = max(0, d.in_flight - 1)
