"""The adapter-affinity policy's load modes (deployments/routing/policy.py), no Ray: a fleet short of host cache
stretches a home instead of spilling cold, a saturated fleet spills nothing cold and grows no home set."""
from __future__ import annotations

import pytest

from deployments.routing.policy import AffinityPolicy
from routing_helpers import ADAPTERS, Clock, policy


def test_a_saturated_fleet_keeps_a_request_to_its_home_and_warm_copies():
    p, clock = policy(replicas=4, capacity=8)
    order = p.order("a")
    for r in p.replicas:
        p.report(r, capacity=8, load=16)      # a full batch and as long a queue everywhere
    p.report(order[2], capacity=8, load=15, host=["a"])
    p.report(order[3], capacity=8, load=10)   # under the others, but cold
    assert p.rank("a") == [order[2], order[0]]            # the warm copy, the home: no cold read
    assert sorted(p.rank(None)) == sorted(p.replicas)     # the base model needs no read
    for _ in range(20):                                   # queued demand does not grow the home set
        p.routed("a", p.rank("a")[0])
    assert p.home_size("a") == 1
    for r in p.replicas:                                  # room again: the cold replicas come back, the home grows
        p.report(r, capacity=8, load=1)
        while p.in_flight[r]:
            p.completed("a", r)
    clock.now += 1
    assert sorted(p.rank("a")) == sorted(p.replicas) and p.home_size("a") > 1


def short_fleet(live: int = 40, **kwargs) -> tuple[AffinityPolicy, Clock]:
    """4 replicas of 10 host slots each; `live` adapters routed once (40: a live adapter in every slot)."""
    p, clock = policy(replicas=4, **kwargs)
    for r in p.replicas:
        p.report(r, capacity=8, load=0, host_slots=10)
    for a in ADAPTERS[:live]:
        p.routed(a, p.rank(a)[0])
        p.completed(a, p.rank(a)[0])
    clock.now += 1.5
    return p, clock


def test_a_fleet_short_of_host_cache_stretches_a_home_instead_of_spilling_cold():
    adapter = ADAPTERS[100]
    ranks = {}
    for ratio in (0.5, None):
        p, clock = short_fleet(short_cache_ratio=ratio, cold_spill_margin=0)   # the factors alone decide
        home = p.rank(adapter)[0]
        for r in p.replicas:   # the home at 6 requests, the others at 4: mean 4.75 with this request, bound 5
            p.report(r, load=6 if r == home else 4)
        ranks[ratio] = (home, p.rank(adapter))
    home, short = ranks[0.5]
    assert short[0] == home                      # 6 < 1.5 x the mean: the home takes it, no cold copy elsewhere
    home, roomy = ranks[None]
    assert roomy[0] != home                      # 6 >= 1.15 x the mean: spills cold to a replica under the bound


def test_the_cold_spill_factor_grows_with_the_share_of_slots_holding_live_adapters():
    """Half the slots live: the normal factor; every slot: short_cold_spill_factor; in proportion between. The
    home share is the short one as soon as the fleet is short."""
    knobs = {}
    for live in (20, 21, 30, 35, 40):
        p, clock = short_fleet(live=live)
        knobs[live] = p.shortage.knobs(clock.now, p.replicas, p.demand)
    assert knobs[20] == (p.home_share, p.cold_spill_factor)                 # 20 of 40: not more than half
    assert {share for share, _ in list(knobs.values())[1:]} == {p.short_knobs[0]}
    assert knobs[30][1] == pytest.approx((p.cold_spill_factor + p.short_knobs[1]) / 2)
    assert p.cold_spill_factor < knobs[21][1] < knobs[30][1] < knobs[35][1] < knobs[40][1] == p.short_knobs[1]


def test_the_short_cache_mode_ends_when_the_live_adapters_fit_again(caplog):
    p, clock = short_fleet()
    with caplog.at_level("INFO", logger="ray.serve"):
        assert p.shortage.knobs(clock.now, p.replicas, p.demand) == p.short_knobs
        clock.now += p.shortage.live_s + 1              # nobody asked for those 40 since: not live any more
        assert p.shortage.knobs(clock.now, p.replicas, p.demand) == (p.home_share, p.cold_spill_factor)
    assert ["short of host cache" in m or "back to home_share" in m for m in caplog.messages] == [True, True]
    assert "40 adapters live, 40 host slots" in caplog.messages[0]
    fresh, clock = policy(replicas=4)            # replicas that do not report their host slots: never short
    for a in ADAPTERS[:25]:
        fresh.routed(a, fresh.rank(a)[0])
    clock.now += 1.5
    assert fresh.shortage.knobs(clock.now, fresh.replicas, fresh.demand) == (fresh.home_share, fresh.cold_spill_factor)
