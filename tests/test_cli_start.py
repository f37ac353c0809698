"""`loraserve serve` starts as the README says, or says why not (issue 19).

- The README's hot-load command, as written (plus this test's own port): the demo's configured adapters lie
  outside `--adapter-root`, and the roots restrict only what callers hot-load, so it starts; a hot-load from
  inside the root works, one of the configured adapter's directory (outside the root) is refused.
- A replica that raises while it starts: the CLI prints the replica's own exception and where its traceback
  and Ray's logs are kept, not only Serve's "Failed to update the deployments".

Each test runs the CLI as a child on loopback (its private Ray on a random port) and stops it by pid.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from processes import alive, process_tree, stop_tree, wait_exit
from ray_clusters import local_env
from serve_fixtures import wait_until
from workers.ray_utils import free_port

pytestmark = pytest.mark.own_cluster   # the CLI starts its own Ray

ROOT = Path(__file__).resolve().parents[1]
README_ROOT = "/path/to/adapters"
START_TIMEOUT_S = 300     # 2 shared cores: a start takes 30-80 s here
SERVING = re.compile(r"loraserve: serving 'loraserve-demo' at (http://127\.0\.0\.1:\d+)/v1")


def readme_hotload_command() -> list[str]:
    """The README's `serve --demo --enable-hotload --adapter-root ...` line, split into its arguments."""
    [line] = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
              if line.strip().startswith(".venv/bin/python -m deployments.cli serve") and "--enable-hotload" in line]
    return line.split()


def start(args: list[str], log: Path, cache: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=local_env(LORASERVE_CACHE=str(cache), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1"),
                                start_new_session=True)


def stop(proc: subprocess.Popen, pids: list[int]) -> int | None:
    """SIGTERM to the CLI (it stops its Ray), then whatever of its tree is left is killed by pid."""
    pids = sorted(set(pids) | set(process_tree(proc.pid)))
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    code, _ = wait_exit(proc, 30)
    stop_tree(proc, pids)
    return code


@pytest.fixture
def demo_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "demo-cache"   # shared with other modules: built once per session


def test_the_readme_hotload_command_starts_and_its_root_bounds_only_hot_loads(tmp_path, demo_cache):
    command = readme_hotload_command()
    assert command[:5] == [".venv/bin/python", "-m", "deployments.cli", "serve", "--demo"], command
    assert command[5:] == ["--enable-hotload", "--adapter-root", README_ROOT], command
    root = tmp_path / "adapters"
    root.mkdir()
    args = [a.replace(README_ROOT, str(root)) for a in command[1:]] + ["--port", str(free_port()),
                                                                         "--num-cpus", "2"]
    log = tmp_path / "serve.log"
    proc, pids = start(args, log, demo_cache), []
    try:
        def serving() -> str | None:
            pids[:] = sorted(set(pids) | set(process_tree(proc.pid)))
            if proc.poll() is not None:
                raise AssertionError(f"the README's hot-load command exited ({proc.returncode}): "
                                     f"{log.read_text()[-3000:]}")
            match = SERVING.search(log.read_text())
            return match and match.group(1)

        url = wait_until(serving, START_TIMEOUT_S, "the README's hot-load command to serve", interval=0.5)
        configured = demo_cache / "demo" / "adapters" / "demo-a"
        shutil.copytree(configured, root / "peft_adapter_dir")
        # the README's curl, with its path under our root: a hot-load from inside the root, then used
        load = requests.post(f"{url}/v1/load_lora_adapter", timeout=120,
                             json={"lora_name": "mine", "lora_path": str(root / "peft_adapter_dir")})
        assert load.status_code == 200, load.text
        done = requests.post(f"{url}/v1/completions", timeout=120,
                             json={"model": "mine", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4, done.text
        # the configured adapters are served though they lie outside the root...
        demo = requests.post(f"{url}/v1/completions", timeout=120,
                             json={"model": "demo-a", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert demo.status_code == 200, demo.text
        # ...but a caller cannot hot-load from there: the root bounds what callers load
        outside = requests.post(f"{url}/v1/load_lora_adapter", timeout=120,
                                json={"lora_name": "theirs", "lora_path": str(configured)})
        assert outside.status_code == 400, outside.text
        assert "not an adapter directory inside the allowed adapter roots" in outside.json()["error"]["message"]
    finally:
        code = stop(proc, pids)
    assert code == 0, log.read_text()[-3000:]
    assert not alive(pids)


def test_a_replica_that_fails_to_start_prints_its_own_exception_and_where_its_log_is(tmp_path, demo_cache):
    missing = tmp_path / "no-such-adapter"
    log = tmp_path / "serve.log"
    proc, pids = start(["-m", "deployments.cli", "serve", "--demo", "--lora", f"ghost={missing}",
                        "--port", str(free_port()), "--num-cpus", "2"], log, demo_cache), []
    try:
        def exited() -> bool:
            pids[:] = sorted(set(pids) | set(process_tree(proc.pid)))
            return proc.poll() is not None

        wait_until(exited, START_TIMEOUT_S, "the CLI to give up on the failing replica", interval=0.5)
    finally:
        stop(proc, pids)
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
