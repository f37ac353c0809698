"""Where a hot adapter's extra homes go and when it takes one (deployments/routing/policy.py `home_set`), no Ray:
an extra home is the replica of least average load, not the next in hash order; a home set grows only while each
of its homes is at the bounded-load limit; inside it a cold home waits until the warm ones are at the limit."""
from __future__ import annotations

from routing_helpers import policy


def settled(p, clock, loads: dict[str, float]) -> None:
    """Every replica reports `loads` for a long while: the loads' averages are these."""
    for _ in range(3):
        clock.now += 60
        for r, load in loads.items():
            p.report(r, capacity=16, load=load)


def test_a_hot_adapters_extra_home_is_the_least_loaded_replica_not_the_next_in_hash_order():
    p, clock = policy(replicas=4, capacity=16, home_share=0.5)
    order = p.order("hot")
    settled(p, clock, {order[0]: 6, order[1]: 12, order[2]: 9, order[3]: 2})
    for _ in range(12):                      # nothing completes: the home reaches the bound, then demand needs more
        p.routed("hot", p.rank("hot")[0])
    home = p.home_set("hot", order, p.home_size("hot"))
    assert home[0] == order[0] and len(home) >= 2
    assert home[1] == order[3]               # idle on average; hash order would have taken the busiest, order[1]
    assert p.home_set("hot", order, 2) == home[:2]   # kept while the set lasts, whatever the loads do now


def test_a_home_set_grows_only_when_each_of_its_homes_is_at_the_bound():
    p, _ = policy(replicas=4, capacity=16, home_share=0.25)
    order = p.order("a")
    for r in order[1:]:
        p.report(r, capacity=16, load=10)    # the other replicas are busy with other adapters
    for _ in range(5):                       # 5 in flight: twice a share of 0.25 x min(16, mean 9)
        p.routed("a", p.rank("a")[0])
    assert p.in_flight[order[0]] == 5        # its home had room for every one of them
    p.rank("a")
    assert p.demand["a"].home == 1           # so no second home (a copy evicts a live adapter)
    for _ in range(7):                       # 12, at the bound (ceil(1.05 x mean)): now the set grows
        p.routed("a", order[0])
    p.rank("a")
    assert p.demand["a"].home > 1


def test_inside_the_home_set_a_cold_home_waits_until_the_warm_ones_are_at_the_bound():
    p, _ = policy(replicas=4, capacity=16, min_spill_load=8)
    order = p.order("x")
    for _ in range(6):
        p.routed("x", order[0])
    p.demand["x"].extra, p.demand["x"].home = [order[1]], 2
    p.report(order[0], capacity=16, load=6, host=["x"])
    p.report(order[1], capacity=16, load=0)              # idle but cold
    assert p.rank("x")[0] == order[0]                    # 6 queued with the adapter beat a read from disk
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
