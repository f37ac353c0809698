"""Replicas with cores of their own on a machine that has two: a CPU quota per LLMServer replica (cgroup v1's
`cpu.cfs_quota_us`, as a container's `--cpus` or a Kubernetes CPU limit sets it).

On this machine the fleet's 4 replicas, their engines, the ingress, the proxy and the client share 2 cores, so a
replica that is busy borrows the cores of one that is idle: where requests land cannot change how many tokens
the fleet makes. Each replica of a real fleet has its own accelerator (or its own cores). With a quota, a
replica (its actor process and its engine process, every thread) gets at most `cores` of CPU time per period,
whatever the others do, and a replica given more work than it can do queues it, as a real one would.

    with ReplicaQuota(app_names, cores=0.4):      # needs root and the cgroup v1 cpu controller
        ...                                        # replicas (re)started meanwhile get their quota within 1 s
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

CPU_CGROUP = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def available() -> str | None:
    """None if quotas can be set here, else why not."""
    if not (CPU_CGROUP / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CPU_CGROUP}"
    if not os.access(CPU_CGROUP, os.W_OK):
        return f"{CPU_CGROUP} is not writable (root is needed)"
    return None


def children_of() -> dict[int, list[int]]:
    """Every process's children, from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue                      # ended meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """pid and every process below it (a replica's engine process is its child)."""
    children = children_of() if children is None else children
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def replica_pids(apps: list[str]) -> dict[str, int]:
    """The alive LLMServer replica actors of these Serve apps: actor name -> pid."""
    from ray._private.state import actors

    classes = {f"ServeReplica:{app}:LLMServer" for app in apps}
    return {a["Name"]: a["Pid"] for a in actors(actor_state_name="ALIVE").values()
            if a["ActorClassName"] in classes and a["Pid"]}


class ReplicaQuota:
    def __init__(self, apps: list[str], cores: float):
        why = available()
        if why:
            raise RuntimeError(f"--replica-cpus needs CPU quotas: {why}")
        if not 0.01 <= cores <= os.cpu_count():
            raise ValueError(f"replica cores must be in [0.01, {os.cpu_count()}], got {cores}")
        self.apps, self.cores = apps, cores
        self.root = CPU_CGROUP / f"loraserve-fleet-{os.getpid()}"
        self.placed: dict[str, set[int]] = {}    # replica -> pids moved into its group
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ReplicaQuota":
        self.root.mkdir(exist_ok=True)
        self.place()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join()
        for group in self.root.iterdir():
            if group.is_dir():
                for pid in (group / "cgroup.procs").read_text().split():
                    _write(CPU_CGROUP / "cgroup.procs", pid)   # back to the root group, unlimited
                group.rmdir()
        self.root.rmdir()

    def _run(self) -> None:
        while not self.stopped.wait(1.0):
            self.place()

    def place(self) -> dict[str, int]:
        """Move every replica's processes (new replicas, new engine processes) into its group: replica -> pids."""
        children = children_of()              # one pass over /proc for every replica
        for name, pid in replica_pids(self.apps).items():
            group = self.root / name.replace("#", "_").replace(":", "_")
            if not group.exists():
                group.mkdir()
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(int(self.cores * PERIOD_US)))
            placed = self.placed.setdefault(name, set())
            for member in descendants(pid, children):
                if member not in placed and _write(group / "cgroup.procs", str(member)):
                    placed.add(member)
        return {name: len(pids) for name, pids in self.placed.items()}

    def throttled_s(self) -> dict[str, float]:
        """Seconds each replica's group spent throttled (at its quota) so far."""
        out = {}
        for group in self.root.iterdir():
            if group.is_dir():
                stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
                out[group.name] = int(stat["throttled_time"]) / 1e9
        return out


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except (ProcessLookupError, OSError):
        return False                             # the process ended meanwhile
