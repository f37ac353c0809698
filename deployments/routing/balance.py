"""Which of its first two rendezvous replicas heads a hot adapter's order: the one with less demand placed on it.

Rendezvous hashing balances the number of adapters per replica, not their demand: under Zipf popularity a few
adapters carry most requests and whichever replica heads their orders carries them. benchmarks/fleet.py's
4 replicas x 200 adapters at Zipf 1.0 put 0.55 / 1.48 / 1.38 / 0.58 of the mean demand on the four hash-first
homes; every request past a home's bounded-load limit then spills, and at that size a spill reads the adapter
cold and evicts another (docs/routing.md, "a fleet short of host cache").

So the adapters with traffic are placed hottest first, each on the one of its first two replicas in rendezvous
order with less demand placed so far (two choices, as in load balancing by the power of two choices, applied
to where an adapter lives rather than where a request goes). An adapter keeps its replica unless the other
would carry less even with it added and by more than its own rate (no flapping), so a hot adapter moves only
when the popularity it rests on changes. The tail (below `min_share` of a replica's share of the requests) keeps its hash-first replica, which is
also the one that prefetches it (prefetch.py).
"""
from __future__ import annotations

from collections.abc import Callable


class DemandBalance:
    def __init__(self, *, min_share: float = 0.05, half_life_s: float = 30.0, period_s: float = 1.0):
        self.min_share, self.half_life_s, self.period_s = min_share, half_life_s, period_s
        self.rates: dict[str, tuple[float, float]] = {}   # adapter -> (requests a second, decayed; when)
        self.swapped: set[str] = set()                   # adapters placed on the second replica of their order
        self._placed = float("-inf")

    def arrived(self, adapter: str, now: float) -> None:
        self.rates[adapter] = (self.rate(adapter, now) + 1.0 / self.half_life_s, now)

    def rate(self, adapter: str, now: float) -> float:
        rate, at = self.rates.get(adapter, (0.0, now))
        return rate * 0.5 ** ((now - at) / self.half_life_s)

    def order(self, adapter: str, order: list[str]) -> list[str]:
        """`order` with its first two swapped where the plan placed the adapter on the second."""
        return [order[1], order[0], *order[2:]] if adapter in self.swapped and len(order) > 1 else order

    def refresh(self, now: float, order: Callable[[str], list[str]], replicas: int) -> None:
        """Re-place at most once a period: an adapter is placed if it carries at least `min_share` of a replica's
        fair share of the requests (the fleet's rate / `replicas`)."""
        if now - self._placed < self.period_s:
            return
        self._placed = now
        rates = {a: self.rate(a, now) for a in self.rates}
        min_rate = self.min_share * sum(rates.values()) / max(1, replicas)
        for gone in [a for a, r in rates.items() if r < min_rate / 100]:
            del self.rates[gone], rates[gone]
        placed: dict[str, float] = {}
        for adapter, rate in rates.items():   # the tail first, where it stays: its hash-first replica
            if rate < min_rate:
                first = order(adapter)[0]
                placed[first] = placed.get(first, 0.0) + rate
        swapped = set()
        for adapter in sorted((a for a, r in rates.items() if r >= min_rate), key=lambda a: -rates[a]):
            candidates = order(adapter)[:2]
            if len(candidates) < 2:
                continue
            rate = rates[adapter]
            current = candidates[adapter in self.swapped]
            other = candidates[adapter not in self.swapped]
            chosen = other if placed.get(other, 0.0) + rate < placed.get(current, 0.0) - rate else current
            placed[chosen] = placed.get(chosen, 0.0) + rate
            if chosen == candidates[1]:
                swapped.add(adapter)
        self.swapped = swapped
