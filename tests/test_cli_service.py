"""`loraserve serve` as the README starts it, one service for the module (a start costs ~20 s of two cores):
the README's hot-load command, plus this test's port and `--tp 2` (what `make serve` runs, with two
tensor-parallel ranks among its processes).

- `--adapter-root` bounds only hot-loads (issue 19): the demo's configured adapters lie outside it and are
  served; a hot-load from inside it works, one from the configured adapter's directory is refused.
- It prints the Ray address of its private Ray (issue 14), and the README's DeploymentHandle example, run as a
  separate script with that address, reaches the app: generate, stream, hot-load.
- Loopback means loopback: every process of its Ray session listens on loopback only.
- SIGTERM stops it and every process it started (the last test: it ends the service).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from processes import (REPO, Listener, alive, decode_address, listening_sockets, process_tree, start_cli, stop_tree,
                       wait_exit)
from serve_fixtures import wait_until
from workers.ray_utils import free_port

README_ROOT = "/path/to/adapters"
START_TIMEOUT_S = 300     # 2 shared cores: a start takes 20-80 s here
SERVING = re.compile(r"loraserve: serving 'loraserve-demo' at (http://127\.0\.0\.1:\d+)/v1")
HINT = re.compile(r'loraserve: Ray at (127\.0\.0\.1:\d+); from a script: ray\.init\(address="\1"\)')
# Every kind of process of the service, as its title shows (Ray renames its workers `ray::<Class>`).
EXPECTED_LISTENERS = ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ServeController", "ProxyActor",
                      "ServeReplica:loraserve:OpenAIIngress", "ServeReplica:loraserve:LLMServer", "AdapterRegistry",
                      "RayWorker")


@dataclasses.dataclass
class Service:
    proc: subprocess.Popen
    url: str
    ray_address: str
    configured: Path    # the demo's configured adapter (outside the --adapter-root)
    inside: Path        # a copy of it inside the root: what the README's hot-loads load
    pids: list[int]
    log: Path


def readme_hotload_command() -> list[str]:
    """The documented `serve --demo --enable-hotload --adapter-root ...` line (docs/adapters.md), split up."""
    [line] = [line.strip() for line in (REPO / "docs" / "adapters.md").read_text().splitlines()
              if line.strip().startswith(".venv/bin/python -m deployments.cli serve") and "--enable-hotload" in line]
    return line.split()


def readme_handle_example() -> str:
    """The README's Python block that uses a DeploymentHandle (docs/serving.md)."""
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "serving.md").read_text(), re.S)
    [block] = [b for b in blocks if "serve.get_deployment_handle" in b]
    return block


@pytest.fixture(scope="module")
def service(tmp_path_factory, demo_cache):
    command = readme_hotload_command()
    assert command[:5] == [".venv/bin/python", "-m", "deployments.cli", "serve", "--demo"], command
    assert command[5:] == ["--enable-hotload", "--adapter-root", README_ROOT], command
    tmp = tmp_path_factory.mktemp("cli")
    root, log = tmp / "adapters", tmp / "serve.log"
    root.mkdir()
    args = [a.replace(README_ROOT, str(root)) for a in command[5:]] + ["--tp", "2", "--num-cpus", "4",
                                                                       "--port", str(free_port())]
    proc, pids = start_cli("--demo", *args, log=log, LORASERVE_CACHE=str(demo_cache)), []
    try:
        def printed(pattern: re.Pattern) -> str | None:
            pids[:] = sorted(set(pids) | set(process_tree(proc.pid)))
            assert proc.poll() is None, f"the CLI exited ({proc.returncode}): {log.read_text()[-3000:]}"
            match = pattern.search(log.read_text())
            return match and match.group(1)

        url = wait_until(lambda: printed(SERVING), START_TIMEOUT_S, "the README's hot-load command to serve",
                         interval=0.5)
        address = wait_until(lambda: printed(HINT), 30, "the CLI to print its Ray address")
        # a completion: the ranks have rendezvoused (store, gloo pairs: listeners) and run a step
        wait_until(lambda: complete(url, "loraserve-demo", 2).status_code == 200, 60, "a first completion")
        configured = demo_cache / "demo" / "adapters" / "demo-a"
        shutil.copytree(configured, root / "peft_adapter_dir")
        yield Service(proc, url, address, configured, root / "peft_adapter_dir", pids, log)
    finally:
        stop_tree(proc, pids)


def complete(url: str, model: str, max_tokens: int) -> requests.Response:
    return requests.post(f"{url}/v1/completions", timeout=120,
                         json={"model": model, "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0})


def hot_load(url: str, name: str, path: Path) -> requests.Response:
    return requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                         timeout=120)


@pytest.mark.own_cluster
def test_the_adapter_root_bounds_only_hot_loads(service):
    url = service.url
    # the README's curl, with its path under our root: a hot-load from inside the root, then used
    assert (load := hot_load(url, "mine", service.inside)).status_code == 200, load.text
    done = complete(url, "mine", 4)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4, done.text
    # the configured adapters are served though they lie outside the root...
    assert (demo := complete(url, "demo-a", 2)).status_code == 200, demo.text
    # ...but a caller cannot hot-load from there: the root bounds what callers load
    outside = hot_load(url, "theirs", service.configured)
    assert outside.status_code == 400, outside.text
    assert "not an adapter directory inside the allowed adapter roots" in outside.json()["error"]["message"]


@pytest.mark.own_cluster
def test_a_script_reaches_the_app_through_the_printed_address(service, tmp_path):
    script = readme_handle_example()
    assert 'ray.init(address="127.0.0.1:<port>")' in script
    script = script.replace("127.0.0.1:<port>", service.ray_address)
    script = script.replace("/path/to/peft_adapter_dir", str(service.inside))
    script += "print('\\nRESULT', out.finish_reason, len(out.token_ids), out.replica_id)\n"
    # as the README says: the script runs with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, nothing else set up
    # (and Python's fault handler, so that a crash shows every thread's stack)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONFAULTHANDLER="1")
    # Ray's default temp dir in this test's: Serve's handle keeps a long poll to the controller on its router
    # thread; an update that arrives as the script exits (the controller answers it with any change) makes
    # it poll again after atexit's ray.shutdown, and that `.remote()` auto-inits a local Ray of the script's own
    # (traced: long_poll.py `_poll_next`), under $TMPDIR/ray (here its socket paths are too long: it fails
    # instead). Seen in 2 of 7 suite runs (its session dir stayed in /tmp/ray). A driver that connects by address
    # takes the cluster's temp dir, never TMPDIR.
    env["TMPDIR"] = str(tmp_path)

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180)

    done = run()
    if done.returncode < 0 and "\nRESULT " in done.stdout:
        # Killed by a signal after its work (RESULT printed, every call answered): a crash in Ray's teardown
        # of the driver at exit (SIGSEGV once in a CI run, no stack printed; 0 of 44 runs under load here).
        # Shown, and run again: a script that crashes every time still fails.
        print(f"the README script died by signal {-done.returncode} at exit:\n{done.stderr[-3000:]}")
        done = run()
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    [result] = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    _, finish_reason, num_tokens, replica = result.split()
    assert (finish_reason, num_tokens) == ("length", "8") and replica
    # the script's hot-load (the README's last line) reached the service
    assert complete(service.url, "mine", 2).status_code == 200


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
    sockets = listening_sockets(process_tree(service.proc.pid))
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
    pids = sorted(set(service.pids) | set(process_tree(service.proc.pid)))
    assert len(alive(pids)) >= 10, "the service's processes"
    service.proc.send_signal(signal.SIGTERM)
    status, waited = wait_exit(service.proc, 10)
    assert status == 0, f"exit status {status} {waited:.1f}s after SIGTERM:\n{service.log.read_text()[-3000:]}"
    print(f"the CLI exited {waited:.1f}s after SIGTERM")
    wait_until(lambda: not alive(pids), 10, "every process the CLI started to end")
