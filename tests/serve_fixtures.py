"""A private Ray on loopback for a test module that must own its cluster (tests marked own_cluster; the others
share one: tests/tiers.py's shared_serve / shared_ray), and a bounded wait."""
from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from shared_cluster import CLUSTER
from workers.ray_utils import init_local_ray

T = TypeVar("T")


@contextmanager
def local_ray(num_cpus: int = 4, resources: dict[str, float] | None = None, prefix: str = "lsr") -> Iterator[str]:
    """Ray alone (loopback, own short temp dir: Ray's socket paths have a length limit), for a module that needs
    its own (custom resources); yields the dir."""
    import ray

    CLUSTER.stop()   # one Ray per process: the shared one goes, the next shared module starts it again
    temp_dir = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    init_local_ray(temp_dir, num_cpus=num_cpus, resources=resources)
    try:
        yield temp_dir
    finally:
        ray.shutdown()
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
