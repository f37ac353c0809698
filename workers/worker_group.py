"""WorkerGroup: one Ray actor per tensor-parallel rank, each running a `Worker`.

Every rank executes every StepPlan (the ranks meet in the layers' collectives);
rank 0 samples and returns the tokens. Ray places the ranks, watches them and
tears them down; the steps do not travel through it: each rank runs one
long-lived call (`RayWorker.run`) that reads every step from a shared-memory
queue the engine writes (shm_broadcast.py) and answers on a queue of its own,
as vLLM's Ray executor does. The engine notices a rank whose loop ended (Ray
reports the call finished or failed) while it waits for an answer. On the CPU
the ranks' collectives go through shared memory too (shm_collectives.py).
Each adapter a plan loads into a slot goes to the ranks through Ray's object
store, one Ray call per rank on that step only: the engine's validated host
copy (one object per node), never its files, which ranks do not open.
LORASERVE_TP_DISPATCH=ray sends every step as a Ray call per rank with gloo's
collectives (the path before shared memory: benchmarks/tp_dispatch.py compares
the two); ranks on another node than the engine are driven that way too.
A rank that cannot install an adapter reports it, and only that adapter's
requests fail. A rank that dies or raises makes the whole
group unhealthy at once: the survivors are killed (they would otherwise wait in
a collective for a peer that never comes) and every later call raises, so Serve
replaces the replica. Ray must already be running (the caller's cluster, or
`ray_utils.init_local_ray` for local runs): an engine never starts one itself.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import replace
from typing import Callable

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lora.ref import AdapterRef
from workers.config import EngineConfig
from workers.device import Platform
from workers.models.plain_config import PlainConfig
from workers.plan import StepOutput, StepPlan
from workers.rank_actor import RayWorker
from workers.ray_utils import actor_resources, worker_bundle_indices, worker_bundles
from workers.runner import RuntimeInfo
from workers.shm_broadcast import QueueTimeout, ShmQueue

PLACEMENT_TIMEOUT_S = 60.0   # our own group on a cluster that lacks the devices: fail, don't wait forever
START_TIMEOUT_S = 900.0      # weight loading of a large model
STEP_TIMEOUT_S = 300.0       # a step may load adapters from disk; a dead rank is reported at once anyway
HEALTH_TIMEOUT_S = 10.0
TP_DISPATCH_ENV = "LORASERVE_TP_DISPATCH"   # "shm" (default) or "ray"


class WorkerGroupError(RuntimeError):
    """A worker rank died, failed or stopped answering; the group (and its engine) is unusable."""


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
        self._steps: ShmQueue | None = None         # shared-memory dispatch: the steps to every rank,
        self._answers: list[ShmQueue] = []           # each rank's answers,
        self._loops: list[ray.ObjectRef] = []        # and each rank's `run` call
        self._collectives = None                     # the CPU collectives' segment
        self._lock = threading.Lock()                # one writer at a time: steps and stats calls
        self.workers, self.placement_group, self.owns_placement_group = spawn_workers(config, runtime, platform)
        try:
            self._start(platform)
        except BaseException:
            self.close()
            raise

    def _start(self, platform: Platform) -> None:
        shm = os.environ.get(TP_DISPATCH_ENV, "shm") != "ray"
        if shm and self.size > 1 and platform.dist_backend == "gloo":   # STRICT_PACK: the ranks share a node
            from workers.shm_collectives import create_segment
            self._collectives = create_segment(self.size)
        [port] = self._gather([self.workers[0].open_store_port.remote()], START_TIMEOUT_S, "start")
        name = self._collectives.name if self._collectives is not None else None
        self._gather([w.start.remote(port, name) for w in self.workers], START_TIMEOUT_S, "start")
        here = ray.get_runtime_context().get_node_id()
        nodes = {p["node_id"] for p in self._gather([w.placement.remote() for w in self.workers], START_TIMEOUT_S,
                                                    "start")}
        if shm and nodes == {here}:   # shared memory reaches the ranks
            self._steps = ShmQueue.create(readers=self.size)
            self._answers = [ShmQueue.create(readers=1) for _ in self.workers]
            self._loops = [w.run.remote(self._steps.handle, a.handle) for w, a in zip(self.workers, self._answers)]

    # ---- calls to every rank -------------------------------------------------
    def execute(self, plan: StepPlan) -> StepOutput:
        refs = [self._ship(ref) for _, ref in plan.lora_loads]
        if self._steps is None:
            plan_ref = ray.put(plan)
            out, *others = self._gather([w.execute.remote(plan_ref, *refs) for w in self.workers],
                                        self.step_timeout_s, "step")
        else:
            if refs:
                self._gather([w.receive_adapters.remote(*refs) for w in self.workers], self.step_timeout_s, "step")
            out, *others = self._call("step", plan)
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

    def _call(self, method: str, *args) -> list:
        """`method` on every rank through shared memory: the answers in rank order. A rank that raised, whose
        loop ended (its process died) or that gave no answer in time fails the group."""
        with self._lock:
            self._check()
            try:
                self._steps.put((method, args), self.step_timeout_s, self._check_loops)
                # no spinning: on a CPU the ranks need the cores. Sleeping up to 1 ms between polls gave 5.6-5.9 ms
                # TP 2 decode steps against 6.5-7.3 at 100 us (tiny Qwen3, loaded 2-core machine, alternating)
                answers = [queue.get(self.step_timeout_s, self._check_loops, spin_s=0) for queue in self._answers]
            except QueueTimeout:
                self._fail(f"{method}: a rank gave no answer within {self.step_timeout_s:.0f}s")
        for rank, (status, value) in enumerate(answers):
            if status == "error":
                self._fail(f"{method}: rank {rank} failed: {value}")
        return [value for _, value in answers]

    def _check_loops(self) -> None:
        """The liveness monitor: a rank's loop that returned or failed (its process died) fails the group."""
        ready, _ = ray.wait(self._loops, num_returns=1, timeout=0)
        if ready:
            rank = self._loops.index(ready[0])
            try:
                ray.get(ready[0])
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc
                self._fail(f"step: rank {rank} failed: {type(cause).__name__}: {cause}", exc)
            self._fail(f"step: rank {rank}'s loop ended")

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
            if self._loops:
                self._check_loops()
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
        with self._lock:   # a step in flight sees its ranks' loops end (the kill) and raises first
            for queue in [self._steps, *self._answers]:
                if queue is not None:
                    queue.close()
            self.workers, self._loops, self._steps, self._answers = [], [], None, []
        if self._collectives is not None:
            self._collectives.close()
            self._collectives.unlink()
            self._collectives = None
        if self.owns_placement_group:
            remove_placement_group(self.placement_group)
            self.owns_placement_group = False
