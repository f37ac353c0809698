"""`loraserve serve` says why it cannot start (issue 19): a replica that raises while it starts makes the CLI
print the replica's own exception and where its traceback and Ray's logs are kept, not only Serve's "Failed to
update the deployments". (The documented commands that start: tests/test_cli_service.py.)

The CLI runs as a child on loopback (its private Ray on a random port) and is stopped by pid.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from processes import alive, process_tree, start_cli, stop_tree
from serve_fixtures import wait_until
from workers.ray_utils import free_port

pytestmark = pytest.mark.own_cluster   # the CLI starts its own Ray

START_TIMEOUT_S = 300     # 2 shared cores: a start takes 30-80 s here


def test_a_replica_that_fails_to_start_prints_its_own_exception_and_where_its_log_is(tmp_path, demo_cache):
    missing = tmp_path / "no-such-adapter"
    log = tmp_path / "serve.log"
    proc, pids = start_cli("--demo", "--lora", f"ghost={missing}", "--port", str(free_port()), "--num-cpus", "2",
                           log=log, LORASERVE_CACHE=str(demo_cache)), []
    try:
        def exited() -> bool:
            pids[:] = sorted(set(pids) | set(process_tree(proc.pid)))
            return proc.poll() is not None

        wait_until(exited, START_TIMEOUT_S, "the CLI to give up on the failing replica", interval=0.5)
    finally:
        stop_tree(proc, pids)
    out = log.read_text()
    assert proc.returncode == 1, out[-3000:]
    [cause] = [line for line in out.splitlines() if line.startswith("loraserve: cannot start:")]
    assert "lora.errors.AdapterNotFoundError" in cause and "'ghost'" in cause and str(missing) in cause, cause
    assert "Failed to update the deployments" not in cause, cause
    [where] = [line for line in out.splitlines() if line.startswith("loraserve: the replica's traceback: ")]
    traceback_file = Path(where.split("traceback: ", 1)[1].split(";", 1)[0])
    assert "Traceback" in traceback_file.read_text() and str(missing) in traceback_file.read_text()
    logs = Path(where.split("Ray's logs of this run: ", 1)[1].split(" ", 1)[0])
    controller_logs = list((logs / "serve").glob("controller_*.log"))
    assert controller_logs and any(str(missing) in p.read_text() for p in controller_logs), where
    assert not alive(pids)
    shutil.rmtree(traceback_file.parent, ignore_errors=True)
