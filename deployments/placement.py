"""Fail fast when an LLMServer replica cannot be placed, instead of Serve waiting without a word.

A replica is one STRICT_PACK placement group: its own bundle plus one device
bundle per tensor-parallel rank, all on one node. On a cluster of fixed
nodes a group that no node can hold never starts, and Serve keeps it
pending forever (`serve run` and the CLI hang). Two checks, both governed by
`LLMConfig.placement_timeout_s`:

- `check_placement` (in `build_app`, so `serve run`, `serve deploy` and the
  CLI): the wanted replicas must fit the nodes as they are (total
  resources), else PlacementError at once.
- `wait_until_running` (the CLI): waits for the application; a replica whose
  group stays pending longer than `placement_timeout_s` (the cluster has the
  room, but it is in use) fails the start.

`placement_timeout_s: null` turns both off: on a cluster whose autoscaler
adds nodes for pending groups (KubeRay, the cluster launcher with
`max_workers`), a pending group is the signal it acts on, and waiting is right.
"""
from __future__ import annotations

import math
import re
import time
from typing import Any

import ray

from deployments.config import LLMConfig

DEPLOYMENT = "LLMServer"
POLL_S = 0.5
IGNORED = ("memory", "object_store_memory")   # Serve reserves neither; every node has some


class PlacementError(RuntimeError):
    """A replica's placement group cannot be satisfied: says what it asked for and what the cluster has."""


class DeployError(RuntimeError):
    """Serve gave up on the application (DEPLOY_FAILED). `str()` is the failing replica's own exception line
    when Serve's message holds one (a replica that raised in __init__), else Serve's message; `details` is
    every failed deployment's full message (the replica's traceback)."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def deploy_error(app) -> DeployError:
    """From an ApplicationStatusOverview in DEPLOY_FAILED: the application's message alone ("Failed to update
    the deployments [...]") says nothing, its deployments' messages carry the replica's traceback."""
    failed = [(name, d.message) for name, d in app.deployments.items()
              if d.message and getattr(d.status, "value", d.status) == "DEPLOY_FAILED"]
    failed = failed or [(name, d.message) for name, d in app.deployments.items() if d.message]
    details = "\n".join(f"{name}: {message}" for name, message in failed)
    for name, message in failed:
        line = exception_line(message)
        if line:
            return DeployError(f"an {name} replica failed to start: {line}", details)
    return DeployError("; ".join(message for _, message in failed) or app.message or "deployment failed", details)


EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Warning)\b(?::.*)?$")


def exception_line(message: str) -> str | None:
    """The last exception line (`module.SomeError: text`) of a traceback inside Serve's message: the cause;
    Ray wraps it (RayTaskError(...), ActorDiedError) and repeats it in the chained tracebacks above."""
    lines = [line.strip() for line in message.splitlines()]
    found = [line for line in lines if EXCEPTION_LINE.match(line) and not line.startswith("ray.exceptions.")]
    return found[-1][:2000] if found else None


def replica_demand(config: LLMConfig) -> dict[str, float]:
    """What one replica needs on one node (its bundles summed: STRICT_PACK)."""
    demand: dict[str, float] = {}
    for bundle in config.placement_group_bundles():
        for resource, amount in bundle.items():
            demand[resource] = demand.get(resource, 0.0) + amount
    return demand


def wanted_replicas(config: LLMConfig) -> int:
    if config.autoscaling_config is None:
        return config.num_replicas or 1
    scaling = config.autoscaling_config
    return max(1, int(scaling.get("initial_replicas") or scaling.get("min_replicas", 1)))


def replicas_per_node(demand: dict[str, float], resources: dict[str, float]) -> int:
    return min(math.floor(resources.get(k, 0.0) / v + 1e-9) for k, v in demand.items() if v > 0)


def check_placement(config: LLMConfig, nodes: list[dict[str, Any]] | None = None) -> None:
    """PlacementError if no arrangement of the wanted replicas fits the cluster's nodes (their totals)."""
    if config.placement_timeout_s is None or (nodes is None and not ray.is_initialized()):
        return
    nodes = [n["Resources"] for n in (ray.nodes() if nodes is None else nodes) if n.get("Alive", True)]
    demand, wanted = replica_demand(config), wanted_replicas(config)
    fits = sum(replicas_per_node(demand, node) for node in nodes)
    if fits < wanted:
        raise PlacementError(
            f"{_asked(config, demand)}, {wanted} replica(s) wanted; the cluster can hold {fits}: its "
            f"{len(nodes)} node(s) have {_have(demand, nodes)}. {_advice()}")


def wait_until_running(app_name: str, placement_timeout_s: float | None, stop=None) -> None:
    """Block until `app_name` is RUNNING; DeployError if Serve gives up, PlacementError if an LLMServer
    replica's placement group stays pending longer than `placement_timeout_s`. `stop()`: give up quietly."""
    from ray import serve

    pending_since: dict[str, float] = {}
    while stop is None or not stop():
        app = serve.status().applications.get(app_name)
        status = app.status.value if app is not None else None   # ApplicationStatus: a str Enum
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":
            raise deploy_error(app)
        now = time.monotonic()
        pending = _pending_groups(app_name)
        pending_since = {name: pending_since.get(name, now) for name in pending}
        for name, group in pending.items():
            if placement_timeout_s is not None and now - pending_since[name] > placement_timeout_s:
                raise PlacementError(_pending_message(group, placement_timeout_s))
        time.sleep(POLL_S)


def _pending_groups(app_name: str) -> dict[str, dict]:
    from ray.util import placement_group_table

    prefix = f"SERVE_REPLICA::{app_name}#{DEPLOYMENT}#"   # Serve names a replica's group after the replica
    return {g["name"]: g for g in placement_group_table().values()
            if g["name"].startswith(prefix) and g["state"] in ("PENDING", "RESCHEDULING")}


def _pending_message(group: dict, timeout_s: float) -> str:
    bundles = list(group["bundles"].values())
    demand: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            demand[resource] = demand.get(resource, 0.0) + amount
    available = {k: ray.available_resources().get(k, 0.0) for k in demand}
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return (f"an {DEPLOYMENT} replica's placement group {bundles} ({group['strategy']}: "
            f"{_fmt(demand)} on one node) was not placed within {timeout_s:g}s; the cluster has "
            f"{_fmt(available)} available, {_have(demand, nodes)} on its {len(nodes)} node(s). {_advice()}")


def _asked(config: LLMConfig, demand: dict[str, float]) -> str:
    tp = config.engine.tensor_parallel_size
    ranks = "" if config.in_process() else f" plus one per tensor-parallel rank (tp={tp})"
    return (f"an {DEPLOYMENT} replica asks for {_fmt(demand)} on one node (placement group "
            f"{config.placement_group_bundles()}, STRICT_PACK: the replica's bundle{ranks})")


def _have(demand: dict[str, float], nodes: list[dict[str, float]]) -> str:
    keys = sorted(k for k in demand if k not in IGNORED)
    total = _fmt({k: sum(node.get(k, 0.0) for node in nodes) for k in keys})
    if len(nodes) < 2:
        return total
    largest = max(nodes, key=lambda node: [node.get(k, 0.0) for k in keys])
    return f"{total} (the largest node: {_fmt({k: largest.get(k, 0.0) for k in keys})})"


def _advice() -> str:
    return ("Lower tensor_parallel_size or num_replicas, give Ray more resources (loraserve serve --num-cpus), "
            "or, where an autoscaler adds nodes, set placement_timeout_s: null (--placement-timeout 0) to wait.")


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"
