"""`loraserve serve` prints the Ray address of its private Ray (issue 14), and the README's DeploymentHandle
example, run as a separate script with that address, reaches the app: generate, stream, hot-load."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_clusters import local_env, processes_of
from serve_fixtures import wait_until
from workers.ray_utils import free_port

pytestmark = pytest.mark.own_cluster   # the CLI starts its own Ray

ROOT = Path(__file__).resolve().parents[1]
HINT = re.compile(r'loraserve: Ray at (127\.0\.0\.1:\d+); from a script: ray\.init\(address="\1"\)')


def readme_handle_example() -> str:
    """The README's Python block that uses a DeploymentHandle."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    [block] = [b for b in blocks if "serve.get_deployment_handle" in b]
    return block


def test_a_script_reaches_loraserve_serve_through_the_printed_address(tmp_path, tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "demo-cache"   # shared with other modules: built once per session
    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--demo", "--port", str(port),
                                 "--num-cpus", "2"], cwd=ROOT, env=local_env(LORASERVE_CACHE=str(cache)),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = None
    try:
        def printed_address():
            if proc.poll() is not None:
                raise AssertionError(f"loraserve serve exited ({proc.returncode}): {log_path.read_text()[-3000:]}")
            match = HINT.search(log_path.read_text())
            return match and match.group(1)

        address = wait_until(printed_address, 240, "loraserve serve to print its Ray address", interval=0.5)
        script = readme_handle_example()
        assert 'ray.init(address="127.0.0.1:<port>")' in script
        script = script.replace("127.0.0.1:<port>", address)
        script = script.replace("/path/to/peft_adapter_dir", str(cache / "demo/adapters/demo-a"))
        script += "print('\\nRESULT', out.finish_reason, len(out.token_ids), out.replica_id)\n"
        # as the README says: the script runs with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, nothing else set up
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        [result] = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
        _, finish_reason, num_tokens, replica = result.split()
        assert (finish_reason, num_tokens) == ("length", "8") and replica
    finally:
        _stop(proc, address)


def _stop(proc: subprocess.Popen, address: str | None) -> None:
    """SIGTERM to the CLI alone (it shuts Serve and its Ray down: its Ray's daemons share its process group and
    must outlive its goodbyes), then SIGKILL to the group and to whatever of that Ray is left, by pid."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
    if address:
        deadline = time.monotonic() + 10
        while (left := processes_of(f"--gcs-address={address}") + processes_of(f"--gcs_server_port="
                                                                                f"{address.split(':')[1]} ")):
            if time.monotonic() > deadline:
                for pid in left:
                    os.kill(pid, signal.SIGKILL)
                break
            time.sleep(0.5)
