"""One loopback Ray + Serve per pytest process, shared by the test modules that only deploy apps or create
actors, started on first use, as Ray's own serve/tests/conftest.py does.

Starting a cluster costs ~10 s of two busy cores; the suite used to start one per module. A module on the
shared cluster (the `shared_serve` / `shared_ray` fixtures of tests/tiers.py) finds it empty and leaves it empty:
`reset` deletes its Serve apps, kills the actors and removes the placement groups it left, and waits until
every CPU is free again, which is what `ray.shutdown` did for it before. A module that must own its cluster
(`local_ray`, its own `ray.init` or a CLI) stops the shared one first (`stop`); the next shared
module starts a new one.
"""
from __future__ import annotations

import shutil
import tempfile

from workers.ray_utils import free_port, init_local_ray

# The most any shared module asks for at once: test_serve_api's (or test_serve_metrics') 2 replicas + a TP=2
# replica's group of 3.
NUM_CPUS = 6
# Serve's own actors, which live as long as the cluster.
SYSTEM_ACTORS = {"ServeController", "ProxyActor"}


class SharedCluster:
    def __init__(self):
        self.url: str | None = None
        self.temp_dir: str | None = None
        self.app_names: dict[str, str] = {}   # every app deployed on it this session -> the module that did

    def start(self) -> str:
        """The base URL of Serve's HTTP proxy; starts Ray + Serve if they are not running."""
        if self.url is None:
            import ray
            from ray import serve

            assert not ray.is_initialized(), "a module left its own Ray running (local_ray exits it)"
            self.temp_dir = tempfile.mkdtemp(prefix="lsh-", dir="/tmp")   # short: Ray's socket path limit
            init_local_ray(self.temp_dir, num_cpus=NUM_CPUS)
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        if self.url is None:
            return
        import ray
        from ray import serve

        self.url = None
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def reset(self, module: str) -> None:
        """Delete every Serve app, actor and placement group that `module` left; fail on a reused app name
        (logs are found by app name, so two modules' apps must not share one)."""
        import ray
        from ray import serve
        from ray._private.state import actors
        from ray.util import placement_group_table

        from serve_fixtures import wait_until

        apps = list(serve.status().applications)
        for app in apps:
            serve.delete(app)
        reused = {app: self.app_names[app] for app in apps if self.app_names.get(app, module) != module}
        self.app_names.update({app: module for app in apps})
        core_worker = ray._private.worker.global_worker.core_worker   # ray.kill's call, by id: no handle needed
        for actor_id, actor in actors(actor_state_name="ALIVE").items():
            if actor["ActorClassName"] not in SYSTEM_ACTORS:
                core_worker.kill_actor(ray.ActorID(bytes.fromhex(actor_id)), True)
        for group_id, group in placement_group_table().items():
            if group["state"] != "REMOVED":
                core_worker.remove_placement_group(ray.PlacementGroupID(bytes.fromhex(group_id)))
        wait_until(lambda: ray.available_resources().get("CPU") == NUM_CPUS, 60,
                   f"every CPU of the shared cluster to be free after {module}")
        assert not reused, f"app names already used by other modules on the shared cluster: {reused}"


CLUSTER = SharedCluster()
