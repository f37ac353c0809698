"""A Ray head started with `ray start` (as an operator would) and Ray's fake-provider autoscaling cluster,
both confined to loopback, their own temp dir and free ports, and stopped by pid.

Run as a script, it is the autoscaling scenario of tests/test_cluster_autoscaling.py by hand
(docs/deployment.md, "Cluster autoscaling on one machine"): the fake NPU cluster and the demo app, until Ctrl-C.

`ray stop` is never used: it stops every Ray process of the machine, other people's
clusters included. Every process of a cluster started here carries its private temp
dir on its command line (GCS, raylets, agents, monitor, workers: `--temp-dir`,
`--session-dir`, `--logs-dir`, ...), so that path names exactly our processes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ray.cluster_utils import AutoscalingCluster

from benchmarks.procfs import command_line, running
from workers.ray_utils import LOCAL_RAY_ENV, LOOPBACK, free_port

RAY = str(Path(sys.executable).with_name("ray"))
# The scenario: a head with CPUs only, and nodes of 2 fake NPUs that the autoscaler adds (0 to 2) for replicas whose
# TP=2 workers reserve an NPU each (device_resource) while computing on the CPU.
FAKE_NPU_NODE = {"resources": {"CPU": 1, "NPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 2}
# metrics_interval_s: Serve 2.60 still pushes autoscaling metrics at this (deprecated) interval, 10 s by default.
SCENARIO_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
                        "downscale_delay_s": 2, "look_back_period_s": 1, "metrics_interval_s": 0.2}


def scenario_app_args(model: str, **overrides) -> dict:
    """LLMConfig args of the scenario: one replica = {CPU: 1} + 2 x {NPU: 1} (STRICT_PACK), which only an NPU
    node holds. Two requests fill a replica, so a burst of three overflows to the replica autoscaling adds."""
    return {"model": model, "device": "cpu", "device_resource": "NPU", "tensor_parallel_size": 2,
            "max_model_len": 256, "max_num_seqs": 8, "autoscaling_config": SCENARIO_AUTOSCALING,
            "max_ongoing_requests": 2,
            "placement_timeout_s": None,   # no NPU node exists until the autoscaler starts one: wait for it
            **overrides}


def local_env(**extra: str) -> dict[str, str]:
    """The environment of a loopback-only Ray: every process binds 127.0.0.1, no token auth, no usage report."""
    return {**os.environ, **LOCAL_RAY_ENV, **extra}


def processes_of(marker: str) -> list[int]:
    """Pids of this user's processes whose command line contains `marker` (e.g. a cluster's private temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:   # gone meanwhile
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def cluster_processes(temp_dir: str) -> list[int]:
    """The processes of the Ray cluster under `temp_dir`: those naming it, and its Ray Client server, which names
    only the GCS's address (so `processes_of(temp_dir)` misses it)."""
    pids = processes_of(temp_dir)
    ports = {arg.split("=", 1)[1] for pid in pids for arg in command_line(pid) if arg.startswith("--gcs_server_port=")}
    clients = [pid for port in ports for pid in processes_of(f"ray.util.client.server --address={LOOPBACK}:{port} ")]
    return sorted({*pids, *clients})


def stop_processes_of(temp_dir: str, grace_s: float = 10.0) -> list[int]:
    """Stop every process of the cluster under `temp_dir` as `ray stop` does, in its order: the raylet, then the
    others (agents, monitor, workers), the GCS last (signalled together, the raylet and the GCS wait for each other
    until they time out); one SIGTERM each, SIGKILL for what is left after its share of `grace_s`. The pids."""
    def rank(pid: int) -> int:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return 1
        return 0 if b"/raylet" in command.split(b"\0")[0] else 2 if b"gcs_server" in command else 1

    stopped: set[int] = set()
    for bucket in (0, 1, 2):
        pids = [pid for pid in cluster_processes(temp_dir) if rank(pid) == bucket]
        stopped.update(pids)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s / 3
            while (pids := [pid for pid in pids if running(pid)]) and time.monotonic() < deadline:
                time.sleep(0.1)
    deadline = time.monotonic() + grace_s
    while (late := processes_of(temp_dir)) and time.monotonic() < deadline:   # started meanwhile: killed now
        stopped.update(late)
        for pid in late:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return sorted(stopped)


def listening_addresses(pids: list[int]) -> set[str]:
    """Local addresses of the TCP sockets these pids listen on (from `ss`), e.g. {"127.0.0.1:6380"}."""
    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    wanted = {f"pid={pid}," for pid in pids}
    return {line.split()[3] for line in out.splitlines() if any(w in line for w in wanted)}


def head_command(temp_dir: str, port: int, num_cpus: int, autoscaling_config: str | None = None,
                 resources: dict[str, float] | None = None) -> list[str]:
    """`ray start --head` on loopback, without a dashboard, every port that has a fixed default given a free one."""
    return [RAY, "start", "--head", f"--node-ip-address={LOOPBACK}", f"--port={port}", f"--temp-dir={temp_dir}",
            f"--num-cpus={num_cpus}", "--include-dashboard=false", f"--dashboard-port={free_port()}",
            f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
            f"--metrics-export-port={free_port()}", "--disable-usage-stats",
            *([f"--autoscaling-config={autoscaling_config}"] if autoscaling_config else []),
            *([f"--resources={json.dumps(resources)}"] if resources else [])]


class LoopbackAutoscalingCluster(AutoscalingCluster):
    """Ray's `AutoscalingCluster` (the fake multi-node provider of Ray's own tests), kept to this test's processes.

    Ray's class is used for its interface and node-type config; three of its parts do not fit here:
    its `start` / `shutdown` run `ray stop --force` (every Ray of the machine), its head listens on
    the default port 6379 and its config starts from an `example.yaml` that the wheel does not ship.
    The fake provider starts each worker node as raylet processes of the head's autoscaler (the
    monitor), on `get_node_ip_address()` (127.0.0.1 under RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0),
    joining the GCS named in `provider.gcs_address`, in the head's temp dir, on random ports.
    """

    def __init__(self, head_resources: dict, worker_node_types: dict, temp_dir: str, **config):
        self.temp_dir = temp_dir
        self.port = free_port()
        super().__init__(head_resources, worker_node_types, **config)

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config):
        assert not autoscaler_v2, "only the v1 autoscaler (Ray's default off KubeRay) is set up here"
        node_types = {**worker_node_types,
                      "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0}}
        return {"cluster_name": "loraserve-fake", "max_workers": sum(t.get("max_workers", 0) for t in
                                                                     worker_node_types.values()),
                "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                             "disable_launch_config_check": True, "gcs_address": self.address},
                "available_node_types": node_types, "head_node_type": "ray.head.default",
                "upscaling_speed": 1.0, "idle_timeout_minutes": 1.0, "auth": {}, "docker": {},
                "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
                "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
                "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
                "rsync_exclude": [], "rsync_filter": [], **config}

    def start(self, _system_config=None, override_env=None) -> None:
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(self._config, f)
        cmd = head_command(self.temp_dir, self.port, int(self._head_resources.get("CPU", 0)), config_path,
                           {k: v for k, v in self._head_resources.items() if k != "CPU"})
        # RAY_FAKE_CLUSTER selects the fake provider; the autoscaler looks every second instead of every 5 s.
        env = local_env(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", **(override_env or {}))
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)

    def shutdown(self) -> list[int]:
        return stop_processes_of(self.temp_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the fake-NPU autoscaling scenario by hand, until Ctrl-C")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the app on 127.0.0.1")
    parser.add_argument("--idle-timeout-s", type=float, default=30, help="how long an idle node lives")
    args = parser.parse_args(argv)
    os.environ.update(LOCAL_RAY_ENV)
    import ray
    import ray._private.ray_constants as ray_constants
    from ray import serve

    ray_constants.ENABLE_RAY_CLUSTER = False   # read when Ray was imported (above, before the environment was set)

    from deployments.app import build_app

    temp_dir = tempfile.mkdtemp(prefix="lsas-", dir="/tmp")
    cluster = LoopbackAutoscalingCluster({"CPU": 1}, {"npu-node": FAKE_NPU_NODE}, temp_dir=temp_dir,
                                         idle_timeout_minutes=args.idle_timeout_s / 60)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False)
        serve.start(proxy_location="HeadOnly", http_options={"host": LOOPBACK, "port": args.port})
        serve.run(build_app(scenario_app_args("demo")), name="loraserve", route_prefix="/")
        print(f"fake NPU cluster at {cluster.address}, serving http://{LOOPBACK}:{args.port}/v1; watch the nodes "
              f"with: RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 {RAY} status --address {cluster.address}", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        if ray.is_initialized():
            serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
