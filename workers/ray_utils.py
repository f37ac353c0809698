"""Ray placement and device helpers for the worker group: pure functions, unit-testable without devices.

Placement contract (DESIGN: workers are created inside the caller's placement
group): a Serve replica's group is one bundle for the replica plus one
`{<resource>: 1}` bundle per TP rank, so rank r uses bundle `len(bundles) - tp + r`
(the last `tp` bundles); a group of exactly `tp` bundles also works. Without a
caller's group the worker group makes its own: `STRICT_PACK`, one bundle per rank,
so every rank is on one node and torch.distributed can rendezvous on 127.0.0.1.
"""
from __future__ import annotations

import os
import socket

from workers.device import Platform

LOOPBACK = "127.0.0.1"
# Set before `import ray` / ray.init: bind every Ray process to loopback, no token auth for local runs,
# and no usage-stats report leaving the machine.
# The serving knobs come with them, inherited by every Ray process of a cluster started with this environment
# (the raylet, then Serve's controller, proxy and replicas); docs/deployment.md "Ray settings" gives them for
# `ray start`:
# - worker niceness 0: Ray starts workers at nice 15 so that its daemons win the CPU, but here a worker is the
#   replica doing the inference, and at 15 any nice-0 process on the node (a client, a log shipper) preempts it;
# - Serve's throughput-optimized mode (user code on the replica's own event loop, no per-item hop between
#   threads or loops, gRPC between proxy, ingress and replica, buffered access logs), with its direct ingress
#   left off so that the HTTP proxy keeps serving the configured host and port, and its logging left as in
#   Serve's default mode: a line is written when it is logged (the mode would hold 1000 lines in memory,
#   so a quiet replica's warnings would not show, and a crash would lose them), also to stderr.
# benchmarks/results/serving_path.md has what they are worth.
SERVING_RAY_ENV = {"RAY_worker_niceness": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                   "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
                   "RAY_SERVE_LOG_TO_STDERR": "1"}
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                 "RAY_USAGE_STATS_ENABLED": "0", **SERVING_RAY_ENV}


def worker_bundles(platform: Platform, tp_size: int) -> list[dict[str, float]]:
    """One bundle per TP rank asking for one device of the platform (`{"NPU": 1}`, `{"GPU": 1}`, `{"CPU": 1}`)."""
    assert tp_size >= 1, tp_size
    return [{platform.ray_resource: 1.0} for _ in range(tp_size)]


def actor_resources(platform: Platform) -> dict:
    """`.options(...)` resources of one worker actor, matching one bundle of `worker_bundles`.

    Accelerator workers ask for no CPU, so a bundle of just `{"NPU": 1}` fits them.
    """
    if platform.ray_resource == "CPU":
        return {"num_cpus": 1}
    if platform.ray_resource == "GPU":
        return {"num_cpus": 0, "num_gpus": 1}
    return {"num_cpus": 0, "resources": {platform.ray_resource: 1}}


def worker_bundle_indices(bundles: list[dict[str, float]], platform: Platform, tp_size: int) -> list[int]:
    """Bundle index of each rank within a caller's placement group (the last `tp_size` bundles)."""
    if len(bundles) < tp_size:
        raise ValueError(f"placement group has {len(bundles)} bundles, tensor_parallel_size={tp_size} needs one "
                         f"{{{platform.ray_resource!r}: 1}} bundle per rank (plus one for the replica)")
    indices = list(range(len(bundles) - tp_size, len(bundles)))
    short = [i for i in indices if bundles[i].get(platform.ray_resource, 0) < 1]
    if short:
        raise ValueError(f"placement group bundles {short} ({[bundles[i] for i in short]}) lack "
                         f"{{{platform.ray_resource!r}: 1}}; the last tensor_parallel_size={tp_size} bundles "
                         f"must each hold one {platform.name} device")
    return indices


def local_device_index(assigned_ids: list[str], visible_devices: str | None) -> int:
    """Logical device index (torch.<device>.set_device) of the first device Ray assigned to this worker.

    Ray normally narrows `*_VISIBLE_DEVICES` to the assigned ids, so this is 0; with
    `RAY_EXPERIMENTAL_NOSET_*` the variable lists more devices (or is unset: all
    physical devices visible) and the index is the assigned id's position in it.
    """
    if not assigned_ids:
        return 0
    first = str(assigned_ids[0])
    if not visible_devices:
        return int(first)
    visible = [v.strip() for v in visible_devices.split(",")]
    if first not in visible:
        raise RuntimeError(f"Ray assigned device {first} but the visible devices are {visible_devices!r}")
    return visible.index(first)


def free_port(host: str = LOOPBACK) -> int:
    """A free TCP port on `host` (the OS picks it; no hard-coded ports)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def listen_on_loopback(backlog: int = 128) -> socket.socket:
    """A TCP socket bound to a free port of 127.0.0.1 and listening (for a server that takes a ready fd)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(backlog)
    return sock


def init_local_ray(temp_dir: str, num_cpus: int = 2, resources: dict[str, float] | None = None):
    """Start a private single-node Ray on loopback (tests, benchmarks, local runs); returns ray.init's context.

    The engine never starts Ray itself: a WorkerGroup without a running Ray raises,
    so an engine inside Serve never creates a second cluster by accident.
    """
    for key, value in LOCAL_RAY_ENV.items():
        if key in SERVING_RAY_ENV:
            os.environ.setdefault(key, value)   # a setting the operator exported wins (benchmarks compare them)
        else:
            os.environ[key] = value
    import ray
    import ray._private.ray_constants as ray_constants

    # Read once when Ray is first imported: if anything imported Ray before us, the
    # variable came too late and Ray would swap 127.0.0.1 for the host's address.
    ray_constants.ENABLE_RAY_CLUSTER = False

    return ray.init(address="local", _temp_dir=temp_dir, include_dashboard=False, num_cpus=num_cpus,
                    resources=resources or {}, log_to_driver=False, configure_logging=False,
                    _node_ip_address=LOOPBACK)
