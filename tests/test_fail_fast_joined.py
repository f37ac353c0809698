"""Fail fast on a cluster the CLI joins (`loraserve serve --address`), the session's shared cluster: a replica
no node can hold fails the start at once with what it asked for and what the cluster has (exit 1); one that does
not get its resources within placement_timeout_s (a busy cluster) fails the start then with what the cluster
has, and the CLI removes its own application only. The CLI's own-cluster cases are
tests/test_fail_fast.py.
"""
from __future__ import annotations

import time

from processes import default_ray_sessions, start_cli, stop_tree, wait_exit
from serve_fixtures import wait_until
from shared_cluster import NUM_CPUS
from workers.ray_utils import free_port

START_BOUND_S = 120   # generous: Python, torch and Ray start on a loaded 2-core machine


def test_impossible_placement_fails_at_once_with_what_it_asked_and_what_the_cluster_has(tmp_path, shared_serve):
    import ray

    started = time.monotonic()
    proc = start_cli("--demo", "--port", str(free_port()), "--address", ray.get_runtime_context().gcs_address,
                     "--tp", str(NUM_CPUS), log=tmp_path / "serve.log")
    try:
        status, _ = wait_exit(proc, START_BOUND_S)
        log = (tmp_path / "serve.log").read_text()
        assert status == 1, log[-3000:]
        print(f"failed {time.monotonic() - started:.1f}s after the CLI started")
        assert f"cannot start: an LLMServer replica asks for {{CPU: {NUM_CPUS + 1}}} on one node" in log, log[-3000:]
        assert f"its 1 node(s) have {{CPU: {NUM_CPUS}}}" in log and "--placement-timeout 0" in log
        assert default_ray_sessions(proc.pid) == [], log[-3000:]
    finally:
        stop_tree(proc, [])
    from ray import serve
    assert "loraserve" not in serve.status().applications   # it failed before deploying anything


def test_a_replica_the_busy_cluster_cannot_place_in_time_fails_the_start(tmp_path, shared_serve):
    """The shared cluster fits a TP=2 replica (3 CPUs on one node), but all CPUs but one are held: after
    placement_timeout_s the CLI gives up."""
    import ray
    from ray import serve
    from ray.util import placement_group, remove_placement_group

    from deployments.adapter_registry import NAMESPACE, registry_name

    hog = placement_group([{"CPU": NUM_CPUS - 1}])
    ray.get(hog.ready(), timeout=60)
    gcs = ray.get_runtime_context().gcs_address
    proc = start_cli("--demo", "--port", str(free_port()), "--address", gcs, "--tp", "2", "--placement-timeout", "3",
                     log=tmp_path / "serve.log")
    try:
        status, _ = wait_exit(proc, START_BOUND_S)
        log = (tmp_path / "serve.log").read_text()
        assert status == 1, log[-3000:]
        assert f"was not placed within 3s; the cluster has {{CPU: 1}} available, {{CPU: {NUM_CPUS}}}" in log, \
            log[-3000:]
        assert default_ray_sessions(proc.pid) == [], log[-3000:]   # its stop started no Ray of its own
    finally:
        stop_tree(proc, [])
    # a cluster it joined: the CLI removed its application only, not Serve or what else runs there
    wait_until(lambda: "loraserve" not in serve.status().applications, 30, "the CLI's app to be deleted")
    assert ray.util.placement_group_table(hog)["state"] == "CREATED"
    remove_placement_group(hog)
    # its registry outlives it until it notices (app_check_s): gone with the cluster before, ended here by name
    # (the shared cluster's reset kills by id only what this process holds a handle of)
    try:
        ray.kill(ray.get_actor(registry_name("loraserve", "loraserve-demo"), namespace=NAMESPACE))
    except ValueError:
        pass   # it noticed first
