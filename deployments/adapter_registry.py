"""The adapter registry of one application: a named Ray actor that restarts with its state, and its clients.

The registry maps adapter name -> source; every change bumps a version. Each
LLMServer replica mirrors it (adapter_mirror.py) and the ingress keeps a copy
for `/v1/models` and `/metrics` (`RegistryView`), so the registry is never on
a request's path: while it is down, requests are served from each replica's
last copy, and only hot-load / unload fail, with a 503
(`RegistryUnavailableError`).

Why a detached, restartable actor with its state in the GCS internal KV (and
not a Serve deployment of the app): Ray restarts a crashed actor at once
(`max_restarts=-1`; no Serve health-check period first) and the new instance
reads its state back from the KV, where Ray keeps its own metadata (and
which outlives a GCS restart with GCS fault tolerance). Its calls fail fast
(`max_task_retries=0`) and every caller bounds them in time, so an outage is
a clean error, never a hang. A registry killed for good (`ray.kill`) is
created again by the next caller and recovers the same way.

It belongs to its application: when the app is deleted (`serve.delete`,
`serve shutdown`) the LLMServer replicas' shutdown hook sees it DELETING and
drops the registry, state and actor, before the deletion completes, so the
next deployment of that name starts with only its configured adapters. An
update of the app (a redeploy) keeps it. As a backstop (replicas killed
during the deletion), the registry drops itself once Serve no longer knows
its app; it asks Serve only while no replica reports (a heartbeat is proof
enough that the app exists).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

import ray
from ray.experimental import internal_kv

logger = logging.getLogger("ray.serve")
NAMESPACE = "loraserve"
HEAD_NODE_RESOURCE = "node:__internal_head__"   # Ray gives it to the head node only
APPLY_TIMEOUT_S = 30.0   # a replica that does not confirm within this is stuck; the caller is told
CALL_TIMEOUT_S = 5.0     # a registry call that takes longer: the registry is down (it restarts in ~1-5 s)
VIEW_TIMEOUT_S = 1.0     # the ingress answers from its last copy after this
APP_CHECK_S = 10.0       # how often a registry without live replicas checks that its application exists
DELETED = (None, "DELETING")   # the application's status once it is being deleted (None: Serve knows it not)


class RegistryUnavailableError(RuntimeError):
    """The registry does not answer (it is restarting after a failure): a 503, the caller may retry."""

    def __init__(self, message: str = "the adapter registry is restarting after a failure; adapters cannot be "
                                      "loaded or unloaded right now (generation is unaffected); retry in a few "
                                      "seconds"):
        super().__init__(message)   # a default, not a fixed text: it is unpickled with its args in the ingress


@ray.remote(num_cpus=0)
class AdapterRegistry:
    def __init__(self, app_name: str, key: str, sync_interval_s: float, app_check_s: float = APP_CHECK_S):
        self._app_name, self._key, self._app_check_s = app_name, key, app_check_s
        self._sources: dict[str, str] = {}
        # name -> the version (content digest, lora/ref.py) its last hot-load read: a hot-load that read other
        # weights from the same source changes it, so every replica re-reads that source (a source string alone
        # would not change); none for a configured adapter not hot-loaded since (whatever its source holds)
        self._versions: dict[str, str] = {}
        self._seeded: set[tuple[str, str]] = set()
        self._version = 0
        self._bumped = asyncio.Event()   # set (and replaced) at every change: what `changes` waits on
        # a live replica reports at least every sync_interval_s (mirror's long poll); one silent for several
        # periods is gone (downscaled or dead)
        self._stale_after_s = max(3.0, 4 * sync_interval_s)
        self._replicas: dict[str, tuple[int, float, dict]] = {}   # id -> (applied version, seen at, stats)
        saved = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if saved is not None:   # a restart: the state as of the last acknowledged change
            state = json.loads(saved)
            self._sources, self._version = state["sources"], state["version"]
            self._versions = state.get("versions", {})
            self._seeded = {tuple(item) for item in state["seeded"]}
        # after a restart, wait_applied first lets every live replica report once (replicas are not persisted)
        self._settled_at = time.monotonic() + (3 * sync_interval_s if saved is not None else 0.0)
        self._app_watch: asyncio.Task | None = None

    def _bump(self) -> None:
        self._version += 1
        self._bumped.set()
        self._bumped = asyncio.Event()

    def _save(self) -> None:
        state = {"version": self._version, "sources": self._sources, "versions": self._versions,
                 "seeded": sorted(self._seeded)}
        internal_kv._internal_kv_put(self._key, json.dumps(state), overwrite=True, namespace=NAMESPACE)

    async def seed(self, adapters: dict[str, str]) -> int:
        """The config's adapters. Every replica calls this at start; a (name, source) is applied once, so a
        replica started later does not bring back a configured adapter that was unloaded since."""
        self._watch_app()
        fresh = {name: src for name, src in adapters.items() if (name, src) not in self._seeded}
        if fresh:
            self._seeded.update(fresh.items())
            changed = {name: src for name, src in fresh.items() if self._sources.get(name) != src}
            if changed:
                self._sources.update(changed)
                self._bump()
            self._save()
        return self._version

    async def register(self, name: str, source: str, version: str) -> int:
        """The registry's version after `name` was hot-loaded from `source`, its weights' digest `version`."""
        if self._sources.get(name) != source or self._versions.get(name) != version:
            self._sources[name], self._versions[name] = source, version
            self._bump()
            self._save()
        return self._version

    async def unregister(self, name: str) -> int | None:
        """The new version, or None for a name that is not registered."""
        if self._sources.pop(name, None) is None:
            return None
        self._versions.pop(name, None)
        self._bump()
        self._save()
        return self._version

    async def lookup(self, name: str) -> str | None:
        return self._sources.get(name)

    async def snapshot(self) -> tuple[int, dict[str, str], dict[str, str]]:
        """(version, name -> source, name -> adapter version: the content digest its last hot-load read)."""
        return self._version, dict(self._sources), dict(self._versions)

    async def report(self, replica_id: str, applied_version: int, stats: dict) -> int:
        """A replica's heartbeat: what it has applied, and its stats; returns the current version."""
        self._watch_app()
        self._replicas[replica_id] = (applied_version, time.monotonic(), stats)
        return self._version

    async def changes(self, known_version: int, timeout_s: float) -> int:
        """A long poll: the current version as soon as it differs from `known_version`, else after `timeout_s`
        (the caller's next heartbeat)."""
        if self._version == known_version:
            try:
                await asyncio.wait_for(self._bumped.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self._version

    async def forget(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    async def wait_applied(self, version: int, timeout_s: float = APPLY_TIMEOUT_S) -> list[str]:
        """Wait until every live replica has applied `version`; returns the ids that had not (empty: all did)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < min(self._settled_at, deadline):
            await asyncio.sleep(0.02)
        while True:
            lagging = [rid for rid, (applied, _, _) in self._live().items() if applied < version]
            if not lagging or time.monotonic() > deadline:
                return lagging
            await asyncio.sleep(0.02)

    async def replica_stats(self) -> dict[str, dict]:
        return {rid: stats for rid, (_, _, stats) in self._live().items()}

    async def live_replicas(self) -> list[str]:
        """The replicas that reported within the last few heartbeats (what prefetch partitions the adapters over)."""
        return sorted(self._live())

    async def drop(self) -> None:
        """Forget everything, persisted state included (the application is deleted); the caller kills us."""
        internal_kv._internal_kv_del(self._key, namespace=NAMESPACE)
        self._sources, self._seeded, self._replicas = {}, set(), {}

    def _live(self) -> dict[str, tuple[int, float, dict]]:
        now = time.monotonic()
        for rid in [r for r, (_, seen, _) in self._replicas.items() if now - seen > self._stale_after_s]:
            del self._replicas[rid]   # gone (downscaled or dead): it no longer holds anything up
        return self._replicas

    def _watch_app(self) -> None:
        if self._app_watch is None:   # started on the first call: __init__ has no running event loop
            self._app_watch = asyncio.get_running_loop().create_task(self._drop_when_app_is_gone())

    async def _drop_when_app_is_gone(self) -> None:
        while True:
            await asyncio.sleep(self._app_check_s)
            if self._live():   # a replica reported lately: its app exists (and Serve is not asked: its client
                continue       # costs this process ~0.6 s of CPU to import, and each check is a controller call)
            try:
                status = await asyncio.wait_for(asyncio.to_thread(app_status, self._app_name), CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001  (the controller is restarting: ask again later)
                continue
            if status in DELETED:
                logger.info("application %r is gone: dropping its adapter registry", self._app_name)
                await self.drop()
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def app_status(app_name: str) -> str | None:
    """The Serve application's status (RUNNING, DELETING, ...); None when Serve or the app does not exist."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        app = serve.status().applications.get(app_name)
    except RayServeException:   # no Serve instance on this cluster (serve shutdown)
        return None
    return None if app is None else app.status.value   # ApplicationStatus: a str Enum


def registry_name(app_name: str, base_model: str) -> str:
    return f"adapters:{app_name}:{base_model}"


def get_registry(app_name: str, base_model: str, sync_interval_s: float):
    """The application's registry, created by whichever caller asks first (and again after `ray.kill`).

    Detached, so it outlives any one replica (autoscaling may stop the one that
    created it); `scheduling_strategy="DEFAULT"` keeps it out of the caller's
    placement group. On the head node (like Serve's controller): placed next to
    its first replica, it would keep that node from ever being scaled down.
    Keyed by app and base model: adapters of another base model are never
    offered to this one.
    """
    name = registry_name(app_name, base_model)
    return AdapterRegistry.options(
        name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", max_restarts=-1,
        max_task_retries=0, scheduling_strategy="DEFAULT", resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote(app_name, name, sync_interval_s)


class RegistryClient:
    """Calls to the app's registry, each bounded in time; any failure is a RegistryUnavailableError."""

    def __init__(self, app_name: str, base_model: str, sync_interval_s: float):
        self.app_name, self._base_model, self._sync_interval_s = app_name, base_model, sync_interval_s
        self.actor = get_registry(app_name, base_model, sync_interval_s)

    async def call(self, remote: Callable[[Any], Awaitable], timeout_s: float = CALL_TIMEOUT_S):
        """`await client.call(lambda registry: registry.snapshot.remote())`."""
        try:
            return await asyncio.wait_for(remote(self.actor), timeout_s)
        except ray.exceptions.ActorDiedError as exc:   # killed for good (ray.kill)
            await self._recreate_unless_app_deleted()
            raise RegistryUnavailableError() from exc
        except (ray.exceptions.RayActorError, asyncio.TimeoutError) as exc:   # restarting
            raise RegistryUnavailableError() from exc

    async def _recreate_unless_app_deleted(self) -> None:
        """The next call finds a new registry, with the persisted state; not while the app is deleted (the
        registry was dropped with it on purpose)."""
        try:
            status = await asyncio.wait_for(asyncio.to_thread(app_status, self.app_name), CALL_TIMEOUT_S)
        except Exception:  # noqa: BLE001  (Serve's controller restarting: try again on a later call)
            return
        if status not in DELETED:
            self.actor = get_registry(self.app_name, self._base_model, self._sync_interval_s)

    async def release_if_app_deleted(self) -> bool:
        """Drop the registry (state and actor) if our application is being deleted; True if it was."""
        try:
            status = await asyncio.wait_for(asyncio.to_thread(app_status, self.app_name), CALL_TIMEOUT_S)
            if status not in DELETED:
                return False
            await asyncio.wait_for(self.actor.drop.remote(), CALL_TIMEOUT_S)
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001  (another replica dropped it first, or it is down: the backstop acts)
            logger.debug("adapter registry of %r: not dropped here", self.app_name, exc_info=True)
            return False
        return True


class RegistryView:
    """The ingress's copy: fresh while the registry answers, the last copy while it restarts."""

    def __init__(self, client: RegistryClient):
        self.client = client
        self.sources: dict[str, str] = {}
        self.stats: dict[str, dict] = {}

    async def adapters(self) -> dict[str, str]:
        try:
            _, self.sources, _ = await self.client.call(lambda registry: registry.snapshot.remote(), VIEW_TIMEOUT_S)
        except RegistryUnavailableError:
            pass
        return self.sources

    async def replica_stats(self) -> dict[str, dict]:
        try:
            self.stats = await self.client.call(lambda registry: registry.replica_stats.remote(), VIEW_TIMEOUT_S)
        except RegistryUnavailableError:
            pass
        return self.stats
