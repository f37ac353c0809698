"""Deployment files: `serve run serve_config.yaml` (a subprocess, its own loopback Ray) answers a completion;
cluster.yaml passes Ray's own cluster-config schema validation."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests
import yaml

from ray_clusters import processes_of
from serve_fixtures import wait_until
from workers.ray_utils import LOCAL_RAY_ENV, free_port

ROOT = Path(__file__).resolve().parents[1]


def test_cluster_yaml_passes_ray_cluster_config_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    assert raw["provider"]["type"] == "local" and "available_node_types" not in raw   # `local` takes IPs
    validate_config(prepare_config(raw))   # what `ray up` runs before touching any machine
    assert any(".[npu]" in command for command in raw["setup_commands"])
    assert len(raw["provider"]["worker_ips"]) == raw["max_workers"]


def test_serve_config_is_a_valid_serve_deploy_schema():
    from ray.serve.schema import ServeDeploySchema

    from deployments.config import LLMConfig

    schema = ServeDeploySchema.model_validate(yaml.safe_load((ROOT / "serve_config.yaml").read_text()))
    app = schema.applications[0]
    assert app.import_path == "deployments.app:build_app"
    config = LLMConfig.model_validate(app.args)
    assert config.autoscaling_config["max_replicas"] >= config.autoscaling_config["min_replicas"] >= 1


@pytest.mark.own_cluster
def test_serve_run_serve_config_answers_a_completion(tmp_path, demo_cache):
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port          # the only change: a free port instead of 8000
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    ray_dir = tempfile.mkdtemp(prefix="lsd-", dir="/tmp")
    # Ray started on loopback in a private dir first; then Ray's own `serve run` command, which reuses it.
    code = (f"from workers.ray_utils import init_local_ray; init_local_ray({ray_dir!r}, num_cpus=2); "
            f"from ray.serve.scripts import cli; cli(['run', {str(config_path)!r}])")
    env = {**os.environ, **LOCAL_RAY_ENV, "LORASERVE_CACHE": str(demo_cache)}
    log = open(tmp_path / "serve_run.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)   # its own process group: stopped as one below
    try:
        def answer():
            if proc.poll() is not None:
                log_text = (tmp_path / "serve_run.log").read_text()[-3000:]
                raise AssertionError(f"serve run exited ({proc.returncode}): {log_text}")
            try:
                r = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                                  json={"model": "loraserve-demo:demo-a", "prompt": "Hello", "max_tokens": 4})
            except requests.ConnectionError:
                return None
            return r if r.status_code == 200 else None

        response = wait_until(answer, 240, "serve run to answer a completion", interval=1.0)
        body = response.json()
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    finally:
        for sig, grace in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):   # SIGINT: serve run shuts Serve down
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        for pid in processes_of(ray_dir):   # any Ray daemon that left the group
            os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(ray_dir, ignore_errors=True)
