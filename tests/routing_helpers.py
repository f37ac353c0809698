"""What the routing policy's tests share: a settable clock and a fleet of replicas reporting their capacity."""
from __future__ import annotations

import random

from deployments.routing.policy import AffinityPolicy


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def policy(replicas=8, capacity=8, **kwargs) -> tuple[AffinityPolicy, Clock]:
    clock = Clock()
    p = AffinityPolicy(clock=clock, rng=random.Random(0), **kwargs)
    p.set_replicas(f"r{i}" for i in range(replicas))
    for r in p.replicas:
        p.report(r, capacity=capacity, load=0)
    return p, clock


ADAPTERS = [f"adapter-{i}" for i in range(2000)]
