"""The two request routers of the fleet simulation (benchmarks/fleet_sim.py), driven as Serve drives them.

- `AffinityRouting` drives deployments.routing.policy.AffinityPolicy, the class our Serve RequestRouter
  (deployments/routing/router.py) is a thin shell around: `update_replicas` -> `report`, `choose_replicas` ->
  `rank` (one replica per tier), `on_request_routed` -> `routed`, `on_request_completed` -> `completed`.
- `ServeDefaultRouting` drives Ray Serve 2.60's own `PowerOfTwoChoicesRequestRouter` (FIFOMixin, LocalityMixin,
  MultiplexMixin): its real `update_replicas` and `choose_replicas` (apply_multiplex_routing: replicas holding the
  model for 1-2 s, else the fewest models, else all; then two at random), on replicas that stand in for
  RunningReplica. `choose_replicas` never awaits, so it is stepped without an event loop; the router's clock
  (`time.time()` in request_router.py:313-324) is the simulation's, through the module's `time` name.

What both share is Serve's loop around choose_replicas, re-implemented in `Router.select` / `retry_in`
(request_router.py, Ray 2.60):
- each tier of candidates in turn goes to `_select_from_candidate_replicas` (:1062-1120): the candidate of
  lowest queue length below `max_ongoing_requests` wins (:1106), else the next tier. Its queue-length cache
  (:869-897) is exact here: one router, +1 on send (:875), -1 on completion (:883);
- when no tier has room, `should_backoff` is set by both routers, so `_choose_replicas_with_backoff`
  (:1190-1259) retries at once the first time (:1244-1246), then sleeps initial_backoff_s * multiplier**attempt,
  at most max_backoff_s (:644-663; 0.025 s, x2, 0.5 s: constants.py:565-572).
The FIFO matching of pending requests to routing tasks (FIFOMixin) is not modelled: each request routes itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
from types import SimpleNamespace

from deployments.routing.policy import AffinityPolicy
from deployments.routing.prefetch import bounded_homes

INITIAL_BACKOFF_S, BACKOFF_MULTIPLIER, MAX_BACKOFF_S = 0.025, 2, 0.5   # ray/serve/_private/constants.py:565-572
PUSH_MODEL_IDS_S = 0.1   # a replica pushes its multiplexed model ids at most this often (constants.py:383)


class Router:
    def __init__(self, replicas: list, clock):
        self.replicas, self.clock = replicas, clock

    def select(self, tiers: list[list[int]]) -> int | None:
        """_select_from_candidate_replicas over the tiers in order (request_router.py:1062-1120)."""
        for tier in tiers:
            best = None
            for i in tier:
                load = self.replicas[i].in_flight
                if load < self.replicas[i].spec.max_ongoing_requests and (best is None or load < best[0]):
                    best = (load, i)
            if best is not None:
                return best[1]
        return None

    @staticmethod
    def retry_in(failures: int) -> float:
        """The wait before the next try after `failures` rounds found no room (request_router.py:1244-1252)."""
        if failures <= 1:
            return 0.0
        return min(INITIAL_BACKOFF_S * BACKOFF_MULTIPLIER ** min(failures - 2, 64), MAX_BACKOFF_S)   # 2**64: past max


class AffinityRouting(Router):
    name = "adapter-affinity"

    def __init__(self, replicas: list, clock, *, stats_period_s: float = 1.0, seed: int = 0,
                 adapters: list[str] = (), prefetch_fill: float = 0.75, **options):
        super().__init__(replicas, clock)
        self.policy = AffinityPolicy(clock=clock, rng=random.Random(seed), **options)
        self.policy.set_replicas(str(r.index) for r in replicas)
        self.stats_period_s = stats_period_s
        ids = [str(r.index) for r in replicas]   # each replica's home adapters, by the replicas' own rule
        self.homes: dict[int, list[str]] = {r.index: [] for r in replicas}
        for adapter, home in sorted(bounded_homes(list(adapters), ids).items()):
            self.homes[int(home)].append(adapter)
        self.home_sets = {index: frozenset(homes) for index, homes in self.homes.items()}
        self.prefetch_fill = prefetch_fill
        self._prefetched_at = -stats_period_s
        self._stats: dict[int, dict] = {r.index: {} for r in replicas}
        self._stats_at = -stats_period_s

    def tick(self, now: float) -> None:
        """Serve's replica-set broadcast: the multiplexed ids every push, record_routing_stats every period
        (deployments/routing/router.py update_replicas: host = the stats' host set | Serve's model ids)."""
        if now - self._stats_at >= self.stats_period_s:
            self._stats_at = now
            for r in self.replicas:
                self._stats[r.index] = {"load": r.in_flight, "device": frozenset(r.slots), "host": frozenset(r.host),
                                        "loading": frozenset(r.loading), "evicts_next": r.evicts_next()}
        for r in self.replicas:
            stats = self._stats[r.index]
            self.policy.report(str(r.index), capacity=r.spec.max_num_seqs, load=stats.get("load"),
                               device=stats.get("device", ()), host=stats.get("host", frozenset()) | set(r.host)
                               | set(r.loading), loading=stats.get("loading", ()),
                               evicts_next=stats.get("evicts_next"), lora_budget=r.spec.max_loras_per_batch,
                               host_slots=r.spec.max_loaded_loras, homes=self.home_sets[r.index])

    def prefetch_targets(self, now: float) -> list[tuple[object, str, frozenset]]:
        """What each replica's HomePrefetcher asks for this period (deployments/routing/prefetch.py `step`): home
        adapters not held, up to `prefetch_fill` of the cache in home adapters, each in place of an adapter it is
        not the home of (none in a device slot) when the cache is full."""
        if now - self._prefetched_at < self.stats_period_s:
            return []
        self._prefetched_at = now
        out = []
        for r in self.replicas:
            homes, held = self.home_sets[r.index], set(r.host) | set(r.loading)
            room = int(r.spec.max_loaded_loras * self.prefetch_fill) - len(held & homes)
            wanted = [a for a in self.homes[r.index] if a not in held][:max(0, room)]
            victims = frozenset(a for a in held if a not in homes and a not in r.slots)
            r.evict_first = victims       # a request's load loses these first too (lora/cache.py prefer_evicting)
            out += [(r, a, victims) for a in wanted]
        return out

    def tiers(self, req) -> list[list[int]]:
        return [[int(r)] for r in self.policy.rank(req.adapter)]

    def routed(self, req) -> None:
        self.policy.routed(req.adapter, str(req.replica))

    def completed(self, req) -> None:
        self.policy.completed(req.adapter, str(req.replica))


class _RunningReplica:
    """What Ray's router reads of a RunningReplica (request_router.py: replica_id, multiplexed_model_ids,
    max_ongoing_requests; node_id / availability_zone for the LocalityMixin)."""

    def __init__(self, replica_id, max_ongoing_requests: int, queue_len):
        self.replica_id, self.max_ongoing_requests = replica_id, max_ongoing_requests
        self.multiplexed_model_ids: set[str] = set()
        self.node_id = self.availability_zone = None
        self.routing_stats: dict = {}
        self._queue_len = queue_len

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self._queue_len()


class ServeDefaultRouting(Router):
    name = "serve-default"
    CLOCK_OFFSET = 1e6   # Ray tests `not multiplexed_start_matching_time` (:313): a start at 0.0 would read unset

    def __init__(self, replicas: list, clock, *, seed: int = 0, adapters: list[str] = ()):
        from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
        from ray.serve._private.request_router import pow_2_router, request_router
        from ray.serve._private.request_router.common import PendingRequest

        super().__init__(replicas, clock)
        random.seed(seed)   # Ray's router draws from the module-level `random`
        self._ray_module, self._sim_time = request_router, SimpleNamespace(time=lambda: clock() + self.CLOCK_OFFSET)
        deployment = DeploymentID(name="LLMServer", app_name="fleet")
        self.loop = asyncio.new_event_loop()
        self.router = pow_2_router.PowerOfTwoChoicesRequestRouter(
            deployment_id=deployment, handle_source=DeploymentHandleSource.UNKNOWN,
            get_curr_time_s=lambda: clock() + self.CLOCK_OFFSET)
        self.running = [_RunningReplica(ReplicaID(unique_id=str(r.index), deployment_id=deployment),
                                        r.spec.max_ongoing_requests, (lambda r=r: r.in_flight)) for r in replicas]
        self.index = {rr.replica_id: i for i, rr in enumerate(self.running)}
        self._pushed: list[frozenset] = [frozenset()] * len(replicas)   # what each replica pushed last tick
        self._metadata, self._pending_request = RequestMetadata, PendingRequest
        self._update()

    @contextlib.contextmanager
    def _simulated_time(self):
        """Ray's router module reads `time.time()`: the simulation's clock while it runs, and Ray's own again
        after (left patched, it broke pickling Serve's router classes in the rest of the test process)."""
        saved, self._ray_module.time = self._ray_module.time, self._sim_time
        try:
            yield
        finally:
            self._ray_module.time = saved

    def _update(self) -> None:
        async def update():
            self.router.update_replicas(self.running)
        with self._simulated_time():
            self.loop.run_until_complete(update())

    def tick(self, now: float) -> None:
        """A replica pushes its model ids (loaded and loading: multiplex.py:126-133) when they changed, every
        0.1 s; the controller's long poll hands the routers the previous push (0.1-0.2 s old here)."""
        changed = False
        for i, r in enumerate(self.replicas):
            ids = self._pushed[i]
            if self.running[i].multiplexed_model_ids != ids:
                self.running[i].multiplexed_model_ids = set(ids)
                changed = True
            self._pushed[i] = frozenset(r.host) | frozenset(r.loading)
        if changed:
            self._update()

    def tiers(self, req) -> list[list[int]]:
        if req.context is None:
            metadata = self._metadata(request_id=str(id(req)), internal_request_id=str(id(req)),
                                      multiplexed_model_id=req.adapter or "")
            req.context = self._pending_request([], {}, metadata, created_at=self.clock() + self.CLOCK_OFFSET,
                                                  future=self.loop.create_future())
        coro = self.router.choose_replicas(self.router._replicas_list, req.context)
        try:
            with self._simulated_time():
                coro.send(None)
        except StopIteration as done:
            return [[self.index[r.replica_id] for r in tier] for tier in done.value]
        coro.close()
        raise RuntimeError("PowerOfTwoChoicesRequestRouter.choose_replicas awaited: this Ray is not 2.60's")

    def routed(self, req) -> None:
        req.context = None

    def completed(self, req) -> None:
        pass
