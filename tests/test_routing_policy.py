"""Adapter-affinity placement (deployments/routing/policy.py), no Ray: hash stability when replicas come and go,
bounded load, home-set growth and shrink, the cold-load budget, the last-copy rule, residency preference."""
from __future__ import annotations

import pytest

from deployments.routing.policy import AffinityPolicy
from routing_helpers import ADAPTERS, policy


def homes(p: AffinityPolicy) -> dict[str, str]:
    return {a: p.rank(a)[0] for a in ADAPTERS}


def test_at_a_light_load_only_an_adapter_past_the_spill_floor_gets_a_second_home():
    p, _ = policy(replicas=4, capacity=16)             # spill floor: a quarter of 16
    p.routed("tail", p.rank("tail")[0])
    for _ in range(5):                                   # 5 of the fleet's 6 requests
        p.routed("top", p.rank("top")[0])
    assert p.home_size("tail") == 1                      # one request in flight: no reason for a second home
    assert p.home_size("top") == 3                       # 5 at half of the floor (4) each


def test_homes_partition_the_adapters_and_move_only_the_share_of_a_replica_that_comes_or_goes():
    p, _ = policy(replicas=8)
    before = homes(p)
    counts = {r: sum(1 for h in before.values() if h == r) for r in p.replicas}
    assert min(counts.values()) > 0.7 * len(ADAPTERS) / 8 and max(counts.values()) < 1.3 * len(ADAPTERS) / 8

    p.set_replicas([*p.replicas, "r8"])
    p.report("r8", capacity=8, load=0)
    after = homes(p)
    moved = {a for a in ADAPTERS if after[a] != before[a]}
    assert all(after[a] == "r8" for a in moved)          # only to the new replica
    assert 0.5 * len(ADAPTERS) / 9 < len(moved) < 1.5 * len(ADAPTERS) / 9

    p.set_replicas(r for r in p.replicas if r != "r3")
    gone = homes(p)
    moved = {a for a in ADAPTERS if gone[a] != after[a]}
    assert moved == {a for a in ADAPTERS if after[a] == "r3"}   # only the removed replica's adapters


def test_every_policy_in_every_process_agrees_on_an_adapters_home():
    a, _ = policy(replicas=16)
    b, _ = policy(replicas=16)
    assert [a.order(x) for x in ADAPTERS[:50]] == [b.order(x) for x in ADAPTERS[:50]]


def test_a_loaded_home_spills_to_the_next_replica_in_hash_order_before_saturating():
    p, _ = policy(replicas=4, min_spill_load=2, load_factor=1.25, cold_spill_factor=1.25, max_home=1)
    adapter = "hot"
    order = p.order(adapter)
    sent = []
    for _ in range(12):          # nothing completes: load builds up
        target = p.rank(adapter)[0]
        p.routed(adapter, target)
        sent.append(target)
    loads = [p.load(r) for r in p.replicas]
    # bounded load: no replica above ceil(1.25 * (total + 1) / n) at any time, so the spread is even
    assert max(loads) <= -(-1.25 * 13 // 4)
    assert sent[0] == order[0] and sent[1] == order[0]     # the home first, while under the bound
    assert sent.index(order[1]) < sent.index(order[2])     # spills follow the hash order
    assert len(set(sent)) >= 3


def test_rank_lists_every_replica_so_a_request_is_never_refused():
    p, _ = policy(replicas=5)
    for r in p.replicas:
        p.report(r, load=7)       # all far over any bound, under a full batch
    for adapter in ("a", "b", None):
        assert sorted(p.rank(adapter)) == sorted(p.replicas)


def test_home_set_grows_with_demand_and_shrinks_one_step_per_cool_down():
    """At full load an adapter with 13 requests in flight needs 4 replicas at half of a replica's capacity each."""
    p, clock = policy(replicas=8, capacity=8, home_share=0.5, cooldown_s=30, demand_half_life_s=5)
    for r in p.replicas:
        p.report(r, capacity=8, load=8)      # other adapters keep every replica at its capacity
    adapter = "busy"
    assert p.home_size(adapter) == 1
    for _ in range(13):                      # 13 in flight, 4 per replica at home_share 0.5 x min(capacity, load)
        p.routed(adapter, p.rank(adapter)[0])
    assert p.home_size(adapter) == 4
    in_flight = dict(p.in_flight)
    p.in_flight.update({r: 0 for r in p.replicas})       # idle again: the first choice is a home member
    assert p.rank(adapter)[0] in p.order(adapter)[:4]
    p.in_flight.update(in_flight)
    for r in list(p.replicas):
        while p.in_flight[r]:
            p.completed(adapter, r)
    sizes = []
    for _ in range(5):
        clock.now += 31
        sizes.append(p.home_size(adapter))
    assert sizes == [3, 2, 1, 1, 1]          # one step per cool-down, never below 1


def test_a_hot_adapter_spreads_over_more_replicas_than_a_cold_one():
    p, _ = policy(replicas=8, capacity=4)
    used = {"hot": set(), "cold": set()}
    in_flight = []
    for i in range(40):
        for adapter in ("hot",) * 4 + ("cold",) * (1 if i % 4 == 0 else 0):
            target = p.rank(adapter)[0]
            p.routed(adapter, target)
            used[adapter].add(target)
            in_flight.append((adapter, target))
        for adapter, target in in_flight[:len(in_flight) // 2]:   # the older half of what runs ends
            p.completed(adapter, target)
        del in_flight[:len(in_flight) // 2]
    assert len(used["hot"]) >= 3 and len(used["cold"]) == 1


def test_inside_the_home_set_device_beats_host_beats_cold():
    p, _ = policy(replicas=6, capacity=8)
    adapter = "x"
    for _ in range(12):
        p.routed(adapter, p.order(adapter)[0])
    home = p.home_set(adapter, p.order(adapter), p.home_size(adapter))
    assert len(home) >= 3
    for r in p.replicas:
        p.in_flight[r] = 0
    p.report(home[2], capacity=8, load=0, device=[adapter])
    p.report(home[1], capacity=8, load=0, host=[adapter])
    assert p.rank(adapter)[:2] == [home[2], home[1]]
    p.report(home[2], capacity=8, load=2, device=[adapter])   # two queued requests outweigh a slot copy
    assert p.rank(adapter)[0] == home[1]


def test_cold_load_budget_moves_spills_to_replicas_with_tokens_left():
    p, clock = policy(replicas=4, capacity=8, cold_loads_per_s=0.5, cold_burst=1, min_spill_load=1, load_factor=1.0)
    order = p.order("a")
    p.report(order[0], capacity=8, load=10)          # the home is over the bound: "a" spills, cold everywhere
    p.replicas[order[1]].tokens = 0.0                # the next in hash order has loaded its budget's worth
    assert p.rank("a") == [order[2], order[3], order[1], order[0]]
    p.routed("a", order[2])
    assert p.replicas[order[2]].tokens == 0.0 and p.replicas[order[2]].residency("a") == "loading"
    p.completed("a", order[2])
    assert p.rank("a")[0] == order[2]                # now the one holding a copy, token or not
    clock.now += 2.0                                 # a token back at 0.5 per second
    p.report(order[2], capacity=8, load=0)           # ... and the copy reported gone (evicted)
    p.replicas[order[2]].sent_cold.clear()
    assert p.rank("a") == [order[1], order[2], order[3], order[0]]   # every budget refilled: hash order again


def test_out_of_budget_home_sends_a_request_to_an_existing_copy_instead_of_loading_cold():
    p, clock = policy(replicas=4, capacity=8, cold_loads_per_s=0.001, cold_burst=1)
    adapter = "a"
    home, other = p.order(adapter)[0], p.order(adapter)[2]
    p.replicas[home].tokens = 0.0                      # its budget is spent
    p.report(other, capacity=8, load=0, host=[adapter])
    assert p.rank(adapter)[0] == other
    p.replicas[home].tokens = 1.0
    assert p.rank(adapter)[0] == home


def test_a_spill_never_evicts_the_last_copy_of_an_adapter_with_traffic():
    p, _ = policy(replicas=3, capacity=8, min_spill_load=1, load_factor=1.0)
    adapter, precious = "spilling", "precious"
    order = p.order(adapter)
    p.report(order[0], capacity=8, load=5, host=[adapter])      # the home is over the bound: spill
    p.report(order[1], capacity=8, load=0, host=[precious], evicts_next=precious)
    p.report(order[2], capacity=8, load=0)
    p.routed(precious, order[1])                                 # precious has traffic, one copy
    p.replicas[order[1]].load = 1
    assert p.rank(adapter)[:2] == [order[2], order[1]]
    p.completed(precious, order[1])
    p.demand[precious].peak = 0                                  # no traffic left: it may go
    p.replicas[order[1]].load = 0
    assert p.rank(adapter)[0] == order[1]


def test_base_model_requests_go_to_the_least_loaded_replica():
    p, _ = policy(replicas=4)
    for i, r in enumerate(sorted(p.replicas)):
        p.report(r, capacity=8, load=4 - i)
    assert p.rank(None)[0] == "r3"
    p.routed(None, "r3")
    p.routed(None, "r3")
    assert p.rank(None)[0] in ("r2", "r3")            # r3: max(2 sent, 1 reported) = r2's 2


@pytest.mark.parametrize("options, message", [({"home_share": 0}, "home_share"), ({"load_factor": 0.9}, "load_factor"),
                                              ({"max_home": 0}, "max_home"),
                                              ({"short_cache_ratio": 0}, "short_cache_ratio"),
                                              ({"short_home_share": 1.5}, "short_home_share"),
                                              ({"short_cold_spill_factor": 0.5}, "short_cold_spill_factor")])
def test_bad_knobs_are_refused_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        AffinityPolicy(**options)


def test_llm_config_routing_sets_serves_request_router():
    from deployments.config import LLMConfig
    options = LLMConfig(routing_options={"load_factor": 1.1}).deployment_options()
    config = options["request_router_config"]
    assert config.request_router_class.endswith("AdapterAffinityRouter")
    assert config.request_router_kwargs == {"load_factor": 1.1}
    assert "request_router_config" not in LLMConfig(routing="multiplex").deployment_options()
    with pytest.raises(ValueError, match="routing_options.*unexpected keyword argument 'bogus'"):
        LLMConfig(routing_options={"bogus": 1})
    with pytest.raises(ValueError, match="routing"):
        LLMConfig(routing="random")


def test_past_the_bound_a_copy_elsewhere_goes_first_then_the_home_then_a_cold_replica():
    p, _ = policy(replicas=4, capacity=8, min_spill_load=1, load_factor=1.0, cold_spill_factor=2.0)
    adapter = "a"
    order = p.order(adapter)
    for r, load in zip(order, (3, 1, 1, 1)):        # mean with this request 1.75: bound 2, cold bound 4
        p.report(r, capacity=8, load=load)
    assert p.rank(adapter)[0] == order[0]            # the home is past the bound, no copy elsewhere: it stretches
    p.report(order[2], capacity=8, load=1, host=[adapter])
    assert p.rank(adapter)[:2] == [order[2], order[0]]   # a warm copy under the bound first, then the home
    p.report(order[0], capacity=8, load=5)            # past the cold bound too: a cold spill before it
    assert p.rank(adapter)[:3] == [order[2], order[1], order[3]]


def test_a_home_takes_cold_spill_margin_requests_past_the_bound_before_one_spills_cold():
    """At a few requests in flight both factors round to the same bound: the margin keeps a cold read elsewhere
    for a home that is really behind."""
    def first(home_load: int, **knobs) -> bool:
        p, _ = policy(replicas=4, capacity=8, **knobs)     # spill floor 2
        order = p.order("a")
        for r in order:
            p.report(r, capacity=8, load=home_load if r == order[0] else 2)
        return p.rank("a")[0] == order[0]
    assert first(2)                                    # under the bound (3 at mean 2.25)
    assert not first(3, cold_spill_margin=0)           # at the bound: cold to the next in hash order
    assert first(3) and first(5)                       # the margin: up to bound + 2 (5 at mean 3)
    assert not first(6)                                # past it (mean 3.25: bound 4, cold bound 6)
    with pytest.raises(ValueError, match="cold_spill_margin"):
        AffinityPolicy(cold_spill_margin=-1)


def test_a_replica_whose_lora_budget_is_full_gives_way_to_a_copy_that_admits_the_adapter_now():
    p, _ = policy(replicas=3, capacity=8, min_spill_load=8)   # loads far under any bound: the budget alone
    adapter = "a"
    order = p.order(adapter)
    for r in order:
        p.report(r, capacity=8, load=0, lora_budget=2)
    for other in ("x", "y"):                          # the home's steps hold two other adapters: budget full
        p.routed(other, order[0])
    assert p.rank(adapter)[0] == order[0]             # no copy elsewhere: a cold replica is not worth it
    p.report(order[2], capacity=8, load=0, host=[adapter], lora_budget=2)
    assert p.rank(adapter)[0] == order[2]
    p.completed("x", order[0])                        # a place in the home's budget again
    assert p.rank(adapter)[0] == order[0]
