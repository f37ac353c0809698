"""A private Ray + Serve on loopback for a test module that must own its cluster (tests marked own_cluster;
the others share one: tests/tiers.py's shared_serve / shared_ray), and a bounded wait."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from shared_cluster import CLUSTER
from workers.ray_utils import free_port, init_local_ray

T = TypeVar("T")


@contextmanager
def local_ray(num_cpus: int = 4, prefix: str = "lsr") -> Iterator[str]:
    """Ray alone (loopback, own short temp dir: Ray's socket paths have a length limit); yields the dir."""
    import ray

    CLUSTER.stop()   # one Ray per process: the shared one goes, the next shared module starts it again
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    init_local_ray(temp_dir, num_cpus=num_cpus)
    try:
        yield temp_dir
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def local_serve(num_cpus: int = 4, env: dict[str, str] | None = None) -> Iterator[str]:
    """Ray (loopback, own temp dir, no dashboard) + Serve HTTP on a free loopback port; yields the base URL.

    `env` is set before Ray starts (Ray's processes read it at start) and restored after.
    """
    CLUSTER.stop()   # one Ray per process: the shared one goes, the next shared module starts it again
    env = env or {}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    temp_dir = tempfile.mkdtemp(prefix="lst-", dir="/tmp")   # short: Ray's socket paths have a length limit
    import ray
    from ray import serve

    init_local_ray(temp_dir, num_cpus=num_cpus)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            shutil.rmtree(temp_dir, ignore_errors=True)


def wait_until(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `probe` until it returns something truthy; fail after `timeout` seconds saying `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(interval)
