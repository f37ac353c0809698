"""Processes read from /proc: a process's descendants, its command line, whether it runs and its CPU seconds
(the serving benchmark's CPU per role, the tests' checks that a service leaves nothing behind)."""
from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str]:
    """/proc/<pid>/stat after the command name (which may hold spaces and parentheses); [] when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def process_tree(root: int) -> list[int]:
    """`root` and its live descendants (Ray's GCS, raylet and agents are children of a driver, workers of the
    raylet, and a replica's engine process is its child)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))):
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        tree.append(pid := todo.pop())
        todo += children.get(pid, [])
    return tree


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (0 when it is gone)."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def command_line(pid: int) -> list[str]:
    """The arguments `pid` was started with ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def running(pid: int) -> bool:
    """Alive and not a zombie (a stopped child not reaped yet, or an orphan its adopter reaps late)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != "Z"
