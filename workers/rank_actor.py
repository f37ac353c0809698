"""RayWorker: one tensor-parallel rank in its own Ray actor process, running a ModelRunner (worker.py).

The rank's steps arrive through `run`, a loop over the engine's shared-memory queue
(shm_broadcast.py), or as one `execute` call each when the engine drives its ranks through Ray
(worker_group.py says when). Health pings and the step's shipped adapters have concurrency
groups of their own, so they are answered while a step runs.
"""
from __future__ import annotations

import os
from datetime import timedelta

import ray

from lora.ref import AdapterRef
from workers.config import EngineConfig
from workers.device import Platform
from workers.plan import StepOutput, StepPlan
from workers.ray_utils import LOOPBACK, listen_on_loopback, local_device_index
from workers.runner import RuntimeInfo
from workers.shm_broadcast import QueueHandle, ShmQueue

DIST_TIMEOUT_S = 300.0       # bounds a collective whose peer vanished without Ray noticing


@ray.remote(concurrency_groups={"health": 1, "adapters": 1, "loop": 1})  # each answers while `run` loops
class RayWorker:
    """One rank in its own process: device from Ray's assignment, then torch.distributed, then the ModelRunner.

    `start` and `execute` share the default concurrency group, one thread, so the (per-thread)
    current device set in `start` still holds in every `execute`; `run`, the steps' loop, has a
    thread of its own and sets the device there again.
    """

    def __init__(self, config: EngineConfig, runtime: RuntimeInfo, platform: Platform, rank: int, world_size: int):
        self.config, self.runtime, self.platform = config, runtime, platform
        self.rank, self.world_size = rank, world_size
        self.runner = None
        self._store_listener = None
        self._adapters: dict[tuple[str, int], object] = {}   # this step's shipped adapters by (name, load id)
        self._incoming: tuple = ()    # the next step's adapters, received through `receive_adapters`

    def placement(self) -> dict:
        """What Ray gave this rank: accelerator ids, the visible-devices variable, the logical device index (and
        the rank's process id, which benchmarks read CPU time of)."""
        ids = ray.get_runtime_context().get_accelerator_ids().get(self.platform.ray_resource, [])
        env = self.platform.visible_devices_env
        visible = os.environ.get(env) if env else None
        return {"rank": self.rank, "accelerator_ids": ids, "visible_devices": visible,
                "device_index": local_device_index(ids, visible), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def open_store_port(self) -> int:
        """Rank 0: a socket listening on loopback for the torch.distributed store; returns its port.

        A TCPStore that binds its own port listens on every interface; handed this
        socket (`master_listen_fd`, torch's documented option) it serves on 127.0.0.1
        only, and no other process can take the port between now and `start`.
        """
        self._store_listener = listen_on_loopback()
        return self._store_listener.getsockname()[1]

    def start(self, port: int, collectives: str | None = None) -> None:
        """`collectives`: the shared-memory segment of the CPU ranks' collectives (None: gloo's)."""
        import torch.distributed as dist

        from workers.device import get_platform
        from workers.parallel import TPGroup
        from workers.worker import make_runner

        platform = get_platform(self.platform.name)   # imports torch_npu here, on the device's process
        device_index = self.placement()["device_index"]
        platform.set_device(device_index)             # before the process group: nccl / hccl bind to it
        tp = TPGroup()
        if self.world_size > 1:
            if platform.dist_backend == "gloo":       # ranks share one node (STRICT_PACK): stay on loopback
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(platform.dist_backend, store=self._store(port), rank=self.rank,
                                    world_size=self.world_size, timeout=timedelta(seconds=DIST_TIMEOUT_S))
            shm = None
            if collectives is not None:
                from workers.shm_collectives import ShmCommunicator
                shm = ShmCommunicator(collectives, self.rank, self.world_size)
            tp = TPGroup(self.rank, self.world_size, dist.group.WORLD, gather_small=platform.dist_backend == "gloo",
                         shm=shm)
        self.runner = make_runner(self.config, self.runtime, platform, self._shipped_adapter, tp, device_index)
        self._device = (platform, device_index)

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
            out = self.runner.execute(plan)
        finally:
            self._adapters = {}   # installed in the slots now: no second host copy kept
        # the other ranks sampled the same tokens: only what they could not install comes back
        return out if self.rank == 0 else out.failed_adapters

    def resident_bytes(self) -> dict:
        return self.runner.resident_bytes()

    @ray.method(concurrency_group="adapters")
    def receive_adapters(self, *adapters) -> None:
        """The next step's slot loads' adapters, in order (Ray resolves them from the object store)."""
        self._incoming = adapters

    def step(self, plan: StepPlan):
        adapters, self._incoming = self._incoming, ()
        return self.execute(plan, *adapters)

    @ray.method(concurrency_group="loop")
    def run(self, steps: QueueHandle, answers: QueueHandle) -> None:
        """The rank's loop: (method, args) from the engine's queue, its result (or error) on this rank's queue.

        Returns on (None, ()) or after a failure, which ends the rank's use: the engine sees the loop end."""
        platform, device_index = self._device
        platform.set_device(device_index)
        steps, answers = ShmQueue.open(steps, self.rank), ShmQueue.open(answers, None)
        try:
            while True:
                method, args = steps.get()
                if method is None:
                    return
                try:
                    answers.put(("ok", getattr(self, method)(*args)))
                except Exception as exc:  # noqa: BLE001  (reported to the engine, which fails the group)
                    answers.put(("error", f"{type(exc).__name__}: {exc}"))
                    return
        finally:
            steps.close()
            answers.close()

    @ray.method(concurrency_group="health")
    def is_alive(self) -> bool:
        return True
