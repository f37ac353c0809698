"""Loopback means loopback: `loraserve serve --demo --tp 2` on 127.0.0.1 (what `make serve` runs, with two
tensor-parallel ranks) listens on loopback only, in every process of its Ray session; SIGTERM stops it and
every process it started."""
from __future__ import annotations

import ipaddress
import signal

import pytest
import requests

from processes import Listener, alive, decode_address, listening_sockets, process_tree, start_cli, stop_tree, wait_exit
from serve_fixtures import wait_until
from workers.ray_utils import free_port

# Every kind of process of the service, as its title shows (Ray renames its workers `ray::<Class>`).
EXPECTED_LISTENERS = ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ServeController", "ProxyActor",
                      "ServeReplica:loraserve:OpenAIIngress", "ServeReplica:loraserve:LLMServer", "AdapterRegistry",
                      "RayWorker")


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("cli") / "serve.log"
    proc = start_cli("--demo", "--tp", "2", "--num-cpus", "4", "--port", str(port), log=log)
    url, pids = f"http://127.0.0.1:{port}", []
    try:
        def answers() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:   # a completion: the ranks have rendezvoused (store, gloo pairs) and run a step
                body = {"model": "loraserve-demo:demo-a", "prompt": "Hello", "max_tokens": 2}
                return requests.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200
            except requests.RequestException:   # not up yet, or still starting the replicas
                return False

        wait_until(answers, 240, "the CLI to serve a completion", interval=1.0)
        wait_until(lambda: "loraserve: serving 'loraserve-demo' at" in log.read_text(), 30,
                   "the CLI to see its application RUNNING")
        pids = process_tree(proc.pid)
        yield proc, pids, log
    finally:
        stop_tree(proc, pids)


@pytest.mark.parametrize("hex_address, text, loopback, wildcard", [
    ("0100007F:1F90", "127.0.0.1", True, False),
    ("00000000:1F90", "0.0.0.0", False, True),
    ("00000000000000000000000000000000:1F90", "::", False, True),
    ("00000000000000000000000001000000:1F90", "::1", True, False),
    ("0000000000000000FFFF00000100007F:1F90", "::ffff:127.0.0.1", True, False),
    ("0A00000A:1F90", "10.0.0.10", False, False),
])
def test_proc_net_addresses_are_decoded(hex_address, text, loopback, wildcard):
    address, port = decode_address(hex_address)
    assert (address, port) == (ipaddress.ip_address(text), 8080)
    listener = Listener(1, "x", address, port)
    assert (listener.loopback, listener.wildcard) == (loopback, wildcard)


@pytest.mark.own_cluster
def test_no_process_of_the_service_listens_beyond_loopback(service):
    proc, pids, _ = service
    sockets = listening_sockets(process_tree(proc.pid))
    outside = [s for s in sockets if not s.loopback]
    assert not outside, "listening beyond loopback:\n" + "\n".join(map(str, outside))
    # the check saw every kind of process: a listener that moved to another process is still checked
    for kind in EXPECTED_LISTENERS:
        assert any(kind in s.name for s in sockets), f"no listening socket of {kind} among:\n" + "\n".join(
            map(str, sockets))
    ranks = {s.pid for s in sockets if "RayWorker" in s.name}
    assert len(ranks) == 2   # rank 0 serves the torch.distributed store; both ranks' gloo pairs listen


@pytest.mark.own_cluster
def test_sigterm_stops_the_cli_and_every_process_it_started(service):
    proc, pids, log = service
    assert len(alive(pids)) >= 10, "the service's processes"
    proc.send_signal(signal.SIGTERM)
    status, waited = wait_exit(proc, 10)
    assert status == 0, f"exit status {status} {waited:.1f}s after SIGTERM:\n{log.read_text()[-3000:]}"
    print(f"the CLI exited {waited:.1f}s after SIGTERM")
    wait_until(lambda: not alive(pids), 10, "every process the CLI started to end")
