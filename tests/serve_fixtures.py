"""A private Ray on loopback for a test module that must own its cluster (tests marked own_cluster; the others
share one: tests/tiers.py's shared_serve / shared_ray), and a bounded wait."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

from shared_cluster import CLUSTER
from workers.ray_utils import LOOPBACK, free_port

T = TypeVar("T")


@contextmanager
def local_ray(num_cpus: int = 4, resources: dict[str, float] | None = None, prefix: str = "lsr") -> Iterator[str]:
    """Ray alone (loopback, own short temp dir: Ray's socket paths have a length limit), for a module that needs
    its own (custom resources); yields the dir.

    The head is started by `ray start`, a process of its own, and this process only connects: a pytest worker
    that ran a Ray driver before keeps gRPC's threads after ray.shutdown, and a head started in-process forks
    its daemons with a Python preexec_fn beside them (once a GCS so forked never ran: ray.init timed out).
    """
    import ray

    from ray_clusters import head_command, local_env, stop_processes_of

    CLUSTER.stop()   # one Ray per process: the shared one goes, the next shared module starts it again
    temp_dir, port = tempfile.mkdtemp(prefix=prefix, dir="/tmp"), free_port()
    try:
        subprocess.run(head_command(temp_dir, port, num_cpus, resources=resources), env=local_env(), check=True,
                       capture_output=True, timeout=120)
        ray.init(address=f"{LOOPBACK}:{port}", log_to_driver=False, configure_logging=False)
        yield temp_dir
    finally:
        ray.shutdown()
        stop_processes_of(temp_dir)
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
