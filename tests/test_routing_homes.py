"""Where a hot adapter's extra homes go and when it takes one (deployments/routing/policy.py `home_set`), no Ray:
an extra home is the less loaded on average of the next two replicas in hash order; in a fleet short of host cache
a home set grows only while each of its homes is at the bounded-load limit, and a cold home waits until the warm ones
are at the limit (with room to spare, neither)."""
from __future__ import annotations

import pytest

from routing_helpers import policy


def settled(p, clock, loads: dict[str, float]) -> None:
    """Every replica reports `loads` for a long while: the loads' averages are these."""
    for _ in range(3):
        clock.now += 60
        for r, load in loads.items():
            p.report(r, capacity=16, load=load)


def short_of_cache(p, clock) -> None:
    """One host slot per replica and 4 adapters live: every slot of the fleet, so the short knobs in full."""
    for r in p.replicas:
        p.report(r, capacity=16, host_slots=1)
    for a in ("x0", "x1", "x2", "x3"):
        p.routed(a, p.order(a)[0])
        p.completed(a, p.order(a)[0])
    clock.now += 1.5
    assert p.shortage.knobs(clock.now, p.replicas, p.demand) == p.short_knobs


def test_a_hot_adapters_extra_home_is_the_less_loaded_of_the_next_two_in_hash_order():
    p, clock = policy(replicas=4, capacity=16, home_share=0.5)
    order = p.order("hot")
    settled(p, clock, {order[0]: 6, order[1]: 12, order[2]: 3, order[3]: 0})
    for _ in range(12):                      # nothing completes: the home reaches the bound, then demand needs more
        p.routed("hot", p.rank("hot")[0])
    home = p.home_set("hot", order, p.home_size("hot"))
    assert home[0] == order[0] and len(home) >= 2
    assert home[1] == order[2]               # not the busy next one; nor the idle fourth, where every adapter would go
    assert p.home_set("hot", order, 2) == home[:2]   # kept while the set lasts, whatever the loads do now


@pytest.mark.parametrize("short", [True, False])
def test_short_of_cache_a_home_set_grows_only_when_each_of_its_homes_is_at_the_bound(short):
    p, clock = policy(replicas=4, capacity=16, home_share=0.25, short_home_share=0.25)
    if short:
        short_of_cache(p, clock)
    order = p.order("a")
    for r in order[1:]:
        p.report(r, capacity=16, load=10)    # the other replicas are busy with other adapters
    for _ in range(5):                       # 5 in flight: twice a share of 0.25 x min(16, mean 9)
        p.routed("a", order[0])
    p.rank("a")
    assert (p.demand["a"].home == 1) == short   # short: its home has room, so no copy to evict a live adapter
    for _ in range(7):                       # 12, at the bound (ceil(1.05 x mean)): now the set grows
        p.routed("a", order[0])
    p.rank("a")
    assert p.demand["a"].home > 1


@pytest.mark.parametrize("short", [True, False])
def test_short_of_cache_a_cold_home_waits_until_the_warm_ones_are_at_the_bound(short):
    p, clock = policy(replicas=4, capacity=16, min_spill_load=8)
    if short:
        short_of_cache(p, clock)
    order = p.order("x")
    for _ in range(6):
        p.routed("x", order[0])
    p.demand["x"].extra, p.demand["x"].home = [order[1]], 2
    p.report(order[0], capacity=16, load=6, host=["x"])
    p.report(order[1], capacity=16, load=0)              # idle but cold
    assert p.rank("x")[0] == (order[0] if short else order[1])   # short: 6 queued with the adapter beat a read
    for _ in range(2):
        p.routed("x", order[0])                          # 8: the home is at the bound
    assert p.rank("x")[0] == order[1]


def test_an_adapter_homed_on_every_replica_still_routes_when_one_leaves():
    """The fleet benchmark's replica kill (4 replicas, its top adapter homed on all 4): ranking it raised once the
    killed replica left, and Serve left each of its requests pending until the replacement joined."""
    p, _ = policy(replicas=4, capacity=4, home_share=0.25)
    for _ in range(16):
        p.routed("top", p.rank("top")[0])
    assert p.home_size("top") == 4
    order = p.order("top")
    p.set_replicas(order[:3])
    assert sorted(p.rank("top")) == sorted(order[:3])
