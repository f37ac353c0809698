"""WorkerGroup: one Ray actor per tensor-parallel rank, each running a `Worker`.

Every rank executes every StepPlan (the ranks meet in the layers' collectives);
rank 0 samples and returns the tokens. The plan is put in the object store once
and every rank reads the same copy; so is each adapter the plan loads into a
slot: the engine's validated host copy (one object per node), never its files,
which ranks do not open. A rank that cannot install an adapter reports it, and
only that adapter's requests fail. A rank that dies or raises makes the whole
group unhealthy at once: the survivors are killed (they would otherwise wait in
a collective for a peer that never comes) and every later call raises, so Serve
replaces the replica. Ray must already be running (the caller's cluster, or
`ray_utils.init_local_ray` for local runs): an engine never starts one itself.
"""
from __future__ import annotations

import collections
import os
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lora.ref import AdapterRef
from workers.config import EngineConfig
from workers.device import Platform
from workers.models.plain_config import PlainConfig
from workers.plan import StepOutput, StepPlan
from workers.ray_utils import (LOOPBACK, actor_resources, listen_on_loopback, local_device_index,
                               worker_bundle_indices, worker_bundles)
from workers.runner import RuntimeInfo

PLACEMENT_TIMEOUT_S = 60.0   # our own group on a cluster that lacks the devices: fail, don't wait forever
START_TIMEOUT_S = 900.0      # weight loading of a large model
STEP_TIMEOUT_S = 300.0       # a step may load adapters from disk; a dead rank is reported at once anyway
HEALTH_TIMEOUT_S = 10.0
DIST_TIMEOUT_S = 300.0       # bounds a collective whose peer vanished without Ray noticing


class WorkerGroupError(RuntimeError):
    """A worker rank died, failed or stopped answering; the group (and its engine) is unusable."""


@ray.remote(concurrency_groups={"health": 1})  # health pings answer while a step runs
class RayWorker:
    """One rank in its own process: device from Ray's assignment, then torch.distributed, then the Worker.

    `start` and `execute` share the default concurrency group, one thread, so the
    (per-thread) current device set in `start` still holds in every `execute`.
    """

    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, platform: Platform, rank: int, world_size: int):
        self.config, self.runtime, self.platform = config, runtime, platform
        self.rank, self.world_size = rank, world_size
        self.worker = None
        self._store_listener = None
        self._adapters: dict[tuple[str, int], object] = {}   # this step's shipped adapters by (name, load id)

    def placement(self) -> dict:
        """What Ray gave this rank: accelerator ids, the visible-devices variable, the logical device index."""
        ids = ray.get_runtime_context().get_accelerator_ids().get(self.platform.ray_resource, [])
        env = self.platform.visible_devices_env
        visible = os.environ.get(env) if env else None
        return {"rank": self.rank, "accelerator_ids": ids, "visible_devices": visible,
                "device_index": local_device_index(ids, visible), "node_id": ray.get_runtime_context().get_node_id()}

    def open_store_port(self) -> int:
        """Rank 0: a socket listening on loopback for the torch.distributed store; returns its port.

        A TCPStore that binds its own port listens on every interface; handed this
        socket (`master_listen_fd`, torch's documented option) it serves on 127.0.0.1
        only, and no other process can take the port between now and `start`.
        """
        self._store_listener = listen_on_loopback()
        return self._store_listener.getsockname()[1]

    def start(self, port: int) -> None:
        import torch.distributed as dist

        from workers.device import get_platform
        from workers.parallel import TPGroup
        from workers.worker import Worker

        platform = get_platform(self.platform.name)   # imports torch_npu here, on the device's process
        device_index = self.placement()["device_index"]
        platform.set_device(device_index)             # before the process group: nccl / hccl bind to it
        tp = TPGroup()
        if self.world_size > 1:
            if platform.dist_backend == "gloo":       # ranks share one node (STRICT_PACK): stay on loopback
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(platform.dist_backend, store=self._store(port), rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=DIST_TIMEOUT_S))
            tp = TPGroup(self.rank, self.world_size, dist.group.WORLD, gather_small=platform.dist_backend == "gloo")
        self.worker = Worker(self.config, self.runtime, platform, self._shipped_adapter, tp, device_index)

    def _shipped_adapter(self, ref: AdapterRef):
        adapter = self._adapters.get(ref)
        if adapter is None or isinstance(adapter, Exception):
            raise adapter or RuntimeError(f"adapter {ref.name!r} (version {ref.version}) was not shipped with the step")
        return adapter

    def _store(self, port: int):
        """The rendezvous store: rank 0 serves it on the loopback socket of `open_store_port`, the others dial it."""
        import torch.distributed as dist

        timeout = timedelta(seconds=DIST_TIMEOUT_S)
        if self.rank == 0:   # the store now owns the socket's fd; the Python object must not close it
            fd = self._store_listener.detach()
            return dist.TCPStore(LOOPBACK, port, self.world_size, True, timeout, wait_for_workers=False,
                                 master_listen_fd=fd)
        return dist.TCPStore(LOOPBACK, port, self.world_size, False, timeout)

    def execute(self, plan: StepPlan, *adapters) -> StepOutput | dict[str, str]:
        """`adapters`: the plan's slot loads' adapters, in order (Ray resolves them from the object store)."""
        self._adapters = {ref: adapter for (_, ref), adapter in zip(plan.lora_loads, adapters)}
        try:
            out = self.worker.execute(plan)
        finally:
            self._adapters = {}   # installed in the slots now: no second host copy kept
        # the other ranks sampled the same tokens: only what they could not install comes back
        return out if self.rank == 0 else out.failed_adapters

    def resident_bytes(self) -> dict:
        return self.worker.resident_bytes()

    @ray.method(concurrency_group="health")
    def is_alive(self) -> bool:
        return True


def spawn_workers(config: EngineConfig, runtime: RuntimeInfo, platform: Platform):
    """One RayWorker per rank (created, not started): (workers, placement group, whether we own it).

    Inside a caller's placement group (a Serve replica) the ranks take its last
    `tensor_parallel_size` bundles; otherwise we reserve our own STRICT_PACK group.
    """
    size = config.tensor_parallel_size
    group = get_current_placement_group()
    owned = group is None
    if owned:
        bundles = worker_bundles(platform, size)
        group = placement_group(bundles, strategy="STRICT_PACK")
        try:
            ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(f"placement group {bundles} (STRICT_PACK, one node) could not be scheduled within "
                               f"{PLACEMENT_TIMEOUT_S:.0f}s; available: {ray.available_resources()}") from None
        indices = list(range(size))
    else:
        indices = worker_bundle_indices(group.bundle_specs, platform, size)
    if runtime is not None:   # (None: actors created, never started, in placement tests)
        runtime = replace(runtime, hf_config=PlainConfig(runtime.hf_config))   # so ranks need not import transformers
    workers = [RayWorker.options(**actor_resources(platform), max_restarts=0, max_task_retries=0,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     group, placement_group_bundle_index=index))
               .remote(config, runtime, platform, rank, size)
               for rank, index in enumerate(indices)]
    return workers, group, owned


class WorkerGroup:
    """The engine's executor when tensor_parallel_size > 1 or distributed_executor == "ray"."""

    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, platform: Platform,
                 get_adapter: Callable[[AdapterRef], object] | None = None, step_timeout_s: float = STEP_TIMEOUT_S):
        if not ray.is_initialized():
            raise RuntimeError("tensor_parallel_size > 1 / distributed_executor='ray' runs one Ray actor per rank, "
                               "but Ray is not initialised: call ray.init(...) (or workers.ray_utils.init_local_ray) "
                               "before creating the engine")
        self.size = config.tensor_parallel_size
        self.step_timeout_s = step_timeout_s
        self.get_adapter = get_adapter
        # adapter version -> its object-store copy, put once however often it is loaded into a slot; as many as
        # the host cache holds
        self._shipped: collections.OrderedDict[AdapterRef, ray.ObjectRef] = collections.OrderedDict()
        self._max_shipped = config.max_loaded_loras
        self.error: str | None = None
        self.workers, self.placement_group, self.owns_placement_group = spawn_workers(config, runtime, platform)
        try:
            [port] = self._gather([self.workers[0].open_store_port.remote()], START_TIMEOUT_S, "start")
            self._gather([w.start.remote(port) for w in self.workers], START_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise

    # ---- calls to every rank -------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        plan_ref = ray.put(plan)
        refs = [self._ship(ref) for _, ref in plan.lora_loads]
        out, *others = self._gather([w.execute.remote(plan_ref, *refs) for w in self.workers], self.step_timeout_s,
                                    "step")
        for failed in others:
            for ref, error in failed.items():
                out.failed_adapters.setdefault(ref, error)
        for ref in out.failed_adapters:
            self._shipped.pop(ref, None)   # the next try ships the engine's copy again
        return out

    def _ship(self, ref: AdapterRef) -> ray.ObjectRef:
        """The validated host copy of this adapter version in the object store, put once; a copy that
        cannot be had is shipped as its error, so the ranks fail that adapter alone."""
        if ref in self._shipped:
            self._shipped.move_to_end(ref)
            return self._shipped[ref]
        try:
            if self.get_adapter is None:
                raise RuntimeError("this worker group was built without an adapter source")
            adapter = self.get_adapter(ref)
        except Exception as exc:  # noqa: BLE001  (a per-adapter fault, reported through the ranks)
            return ray.put(RuntimeError(f"adapter {ref.name!r}: no validated copy to ship: {exc}"))
        self._shipped[ref] = ray.put(adapter)
        while len(self._shipped) > self._max_shipped:
            self._shipped.popitem(last=False)
        return self._shipped[ref]

    def resident_bytes(self) -> list[dict]:
        """Per rank: parameter bytes by name, LoRA slot bytes, KV cache bytes."""
        return self._gather([w.resident_bytes.remote() for w in self.workers], self.step_timeout_s, "resident_bytes")

    def _gather(self, refs: list, timeout_s: float, what: str) -> list:
        """Every result, in rank order; the first failure (or the deadline) fails the group at once.

        ray.wait on one ref at a time, so a dead rank is reported as soon as Ray
        knows, even while the other ranks are still blocked waiting for it.
        """
        self._check()
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail(f"{what}: ranks {sorted(rank_of[r] for r in pending)} gave no answer within "
                           f"{timeout_s:.0f}s")
            try:
                ray.get(ready[0])
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc
                self._fail(f"{what}: rank {rank_of[ready[0]]} failed: {type(cause).__name__}: {cause}", exc)
        return ray.get(refs)

    # ---- health ----------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            raise WorkerGroupError(f"worker group is unhealthy ({self.error}); restart the engine")

    def _fail(self, reason: str, cause: BaseException | None = None):
        self.error = reason
        self._kill_workers()
        raise WorkerGroupError(f"worker group failed: {reason}; the engine is unhealthy") from cause

    def is_healthy(self) -> bool:
        """False once any rank failed, or when a rank is dead or does not answer a ping now."""
        if self.error is not None:
            return False
        try:
            self._gather([w.is_alive.remote() for w in self.workers], HEALTH_TIMEOUT_S, "health check")
        except WorkerGroupError:
            return False
        return True

    def _kill_workers(self) -> None:
        for worker in self.workers:
            ray.kill(worker, no_restart=True)

    def close(self) -> None:
        if self.error is None:
            self.error = "closed"
        self._kill_workers()
        self.workers = []
        if self.owns_placement_group:
            remove_placement_group(self.placement_group)
            self.owns_placement_group = False
