"""docs/deployment.md's local Ray by hand (issue 14): its `ray start` + `serve deploy` + `serve status` + curl commands,
run as written, with this test's own free ports, temp dir and serve_config.yaml copy (only its HTTP port differs).

The head is stopped by the pids of its processes, never with `ray stop` (which would stop
every Ray of the machine).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from benchmarks.procfs import running
from ray_clusters import cluster_processes, listening_addresses, local_env, processes_of, stop_processes_of
from serve_fixtures import wait_until
from workers.ray_utils import SERVING_RAY_ENV, free_port

ROOT = Path(__file__).resolve().parents[1]
README_TEMP_DIR = "/tmp/loraserve-ray"
PORT = re.compile(r"(?<=[:=])(\d{4,5})\b")


def readme_commands() -> list[str]:
    """The shell commands between the README's local-ray markers (docs/deployment.md), continuation lines joined."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    block = text.split("<!-- local-ray:start -->", 1)[1].split("<!-- local-ray:end -->", 1)[0]
    body = block.split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_readme_has_the_four_steps_on_loopback_and_no_default_port():
    *exports, start, deploy, status, curl = readme_commands()
    assert exports[0].startswith("export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled")
    assert all(f"{key}={value}" in " ".join(exports).split() for key, value in SERVING_RAY_ENV.items())
    assert start.startswith(".venv/bin/ray start --head --node-ip-address=127.0.0.1")
    assert "--dashboard-host=127.0.0.1" in start and f"--temp-dir={README_TEMP_DIR}" in start
    assert deploy.startswith(".venv/bin/serve deploy serve_config.yaml --address http://127.0.0.1:")
    assert status.startswith(".venv/bin/serve status --address http://127.0.0.1:")
    assert curl.startswith("curl http://127.0.0.1:")
    ports = {int(p) for p in PORT.findall(" ".join([start, deploy, status, curl]))}
    assert not ports & {6379, 8265, 10001, 52365}        # Ray's defaults: another Ray of this machine has them
    # the script address the docs give is the head's port, and serve_config.yaml points at this dashboard
    assert f'ray.init(address="127.0.0.1:{PORT.search(start.split("--port")[1]).group(1)}")' in \
        (ROOT / "docs" / "deployment.md").read_text()
    assert deploy.split("serve deploy ")[1] in (ROOT / "serve_config.yaml").read_text()


@pytest.fixture
def workspace(tmp_path, demo_cache):
    temp_dir = tempfile.mkdtemp(prefix="lslc-", dir="/tmp")   # short: Ray's socket paths have a length limit
    yield tmp_path, temp_dir, demo_cache
    started = cluster_processes(temp_dir)   # its Ray Client server included
    stop_processes_of(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not [pid for pid in started if running(pid)], "a process of the head outlived its stop"


@pytest.mark.own_cluster
def test_readme_commands_deploy_serve_config_and_report_it_running(workspace):
    tmp_path, temp_dir, demo_cache = workspace
    commands = readme_commands()
    ports = {port: str(free_port()) for port in sorted({p for c in commands for p in PORT.findall(c)})}
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = int(ports[str(config["http_options"]["port"])])
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))

    def ours(command: str) -> str:
        command = PORT.sub(lambda m: ports[m.group(1)], command)
        command = command.replace(README_TEMP_DIR, temp_dir).replace(".venv/bin/", f"{Path(sys.executable).parent}/")
        return command.replace("serve_config.yaml", str(config_path))

    *exports, start, deploy, status, curl = (ours(c) for c in commands)
    export = "\n".join(exports)
    # the demo model: generated once per test session (shared with other modules), never into the checkout.
    # TMPDIR: Ray's dashboard starts a multiprocessing forkserver, whose socket dir (pymp-*) outlives the head's
    # stop; in the private temp dir, the fixture removes it.
    env = local_env(LORASERVE_CACHE=str(demo_cache), TMPDIR=temp_dir)

    def run(command: str, timeout: float = 120) -> str:
        done = subprocess.run(["bash", "-c", f"{export}\n{command}"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, (command, done.returncode, done.stdout[-2000:], done.stderr[-2000:])
        return done.stdout

    run(start)
    daemons = processes_of(temp_dir)
    addresses = listening_addresses(daemons)
    assert addresses and all(a.startswith(("127.0.0.1:", "[::ffff:127.0.0.1]:")) for a in addresses), addresses
    run(deploy)

    def app_status():
        app = (yaml.safe_load(run(status)) or {}).get("applications", {}).get("loraserve", {})
        assert app.get("status") not in ("DEPLOY_FAILED", "UNHEALTHY"), app
        return app if app.get("status") == "RUNNING" else None

    app = wait_until(app_status, 240, "serve status to report loraserve RUNNING", interval=2.0)
    assert set(app["deployments"]) == {"OpenAIIngress", "LLMServer"}
    models = yaml.safe_load(run(curl))                      # JSON is YAML
    assert {m["id"] for m in models["data"]} >= {"loraserve-demo", "demo-a", "demo-b"}
