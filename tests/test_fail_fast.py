"""Fail fast on impossible placement, and SIGTERM at any point: the `loraserve serve` CLI as a child process.

A replica no node can hold fails the start at once with what it asked for and what the cluster has (exit 1),
and one that does not get its resources within placement_timeout_s (a busy cluster the CLI joins) fails then
(both in tests/test_fail_fast_joined.py, on the shared cluster); SIGTERM stops
the CLI within 10 s whether it is starting Ray, blocked waiting for its replica, or serving, and leaves no
process behind. placement_timeout_s: null waits (an autoscaler may add the node).
"""
from __future__ import annotations

import signal
import time

import pytest

from benchmarks.procfs import command_line
from deployments.config import LLMConfig
from deployments.placement import PlacementError, check_placement
from processes import alive, process_tree, start_cli, stop_tree, wait_exit
from serve_fixtures import wait_until
from workers.ray_utils import free_port

STOP_BOUND_S = 10.0   # issue 10: SIGTERM stops the CLI at any point within this
START_BOUND_S = 120   # generous: Python, torch and Ray start on a loaded 2-core machine


def run_cli(tmp_path, *args: str):
    return start_cli("--demo", "--port", str(free_port()), *args, log=tmp_path / "serve.log")


def sigterm_and_check(proc, tmp_path) -> None:
    pids = process_tree(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
        status, waited = wait_exit(proc, STOP_BOUND_S)
        log = (tmp_path / "serve.log").read_text()
        assert status is not None, f"still running {waited:.1f}s after SIGTERM:\n{log[-3000:]}"
        print(f"exit status {status}, {waited:.1f}s after SIGTERM")
        wait_until(lambda: not alive(pids), 10, "every process the CLI started to end")
    finally:
        stop_tree(proc, pids)


@pytest.mark.parametrize("nodes, tp, replicas, fits", [
    ([{"CPU": 2.0}], 2, 1, False),                 # needs 1 + tp CPUs on one node
    ([{"CPU": 3.0}], 2, 1, True),
    ([{"CPU": 2.0}, {"CPU": 2.0}], 2, 1, False),   # STRICT_PACK: 4 CPUs in all, but not on one node
    ([{"CPU": 6.0}, {"CPU": 3.0}], 2, 3, True),
    ([{"CPU": 6.0}, {"CPU": 2.0}], 2, 3, False),
])
def test_check_placement_counts_whole_replicas_per_node(nodes, tp, replicas, fits):
    config = LLMConfig(device="cpu", tensor_parallel_size=tp, num_replicas=replicas)
    cluster = [{"Alive": True, "Resources": {**node, "memory": 1e9}} for node in nodes]
    if fits:
        check_placement(config, cluster)
    else:
        with pytest.raises(PlacementError, match=r"asks for \{CPU: 3\} on one node.*can hold"):
            check_placement(config, cluster)
    # an autoscaler may add the node: waiting is then right
    check_placement(config.model_copy(update={"placement_timeout_s": None}), cluster)


def test_placement_timeout_flag():
    from deployments.cli import config_from_args, parse_args

    assert config_from_args(parse_args(["serve", "--demo"])).placement_timeout_s == 30
    assert config_from_args(parse_args(["serve", "--demo", "--placement-timeout", "5"])).placement_timeout_s == 5
    assert config_from_args(parse_args(["serve", "--demo", "--placement-timeout", "0"])).placement_timeout_s is None


@pytest.mark.own_cluster
def test_sigterm_while_blocked_waiting_for_a_replica_stops_the_cli(tmp_path):
    proc = run_cli(tmp_path, "--tp", "2", "--num-cpus", "2", "--placement-timeout", "0")   # waits forever
    wait_until(lambda: proc.poll() is not None or "Started Serve" in (tmp_path / "serve.log").read_text(),
               START_BOUND_S, "Serve to start")
    time.sleep(2)   # in serve.run's wait now: the replica's placement group stays pending
    assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
    sigterm_and_check(proc, tmp_path)


@pytest.mark.own_cluster
def test_sigterm_while_ray_starts_stops_the_cli(tmp_path):
    proc = run_cli(tmp_path, "--num-cpus", "2")
    wait_until(lambda: proc.poll() is not None or any(
        "gcs_server" in " ".join(command_line(pid)) for pid in process_tree(proc.pid)), START_BOUND_S,
        "Ray's GCS to start")
    assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
    sigterm_and_check(proc, tmp_path)   # inside ray.init: the raylet and agents are still starting
