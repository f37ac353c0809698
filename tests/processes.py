"""Processes of a running service, read from /proc: its process tree and the TCP sockets they listen on,
and the `loraserve serve` CLI started as a child on loopback."""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.procfs import command_line, process_tree, running
from workers.ray_utils import LOCAL_RAY_ENV

LISTEN = "0A"   # TCP_LISTEN in /proc/net/tcp{,6}
REPO = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 15   # a CLI stops within 10 s of SIGTERM (tests/test_fail_fast.py)


@dataclasses.dataclass(frozen=True)
class Listener:
    pid: int
    name: str            # the process title: `ray::RayWorker`, `.../raylet ...`
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int

    @property
    def loopback(self) -> bool:
        mapped = getattr(self.address, "ipv4_mapped", None)   # ::ffff:127.0.0.1, from a dual-stack socket
        return self.address.is_loopback or bool(mapped and mapped.is_loopback)

    @property
    def wildcard(self) -> bool:
        return self.address.is_unspecified

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.name[:60]}) on {self.address}:{self.port}"


def decode_address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """`0100007F:1F90` -> (127.0.0.1, 8080): /proc/net/tcp{,6} print each 32-bit word in host (little) endian."""
    address, port = hex_address.split(":")
    raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
    return ipaddress.ip_address(raw), int(port, 16)


def engine_processes(root: int) -> list[int]:
    """The engine processes (workers/engine_process.py's child) among `root`'s
    descendants."""
    return [pid for pid in process_tree(root)[1:] if "workers.engine_process" in command_line(pid)]


def listening_sockets(pids: list[int]) -> list[Listener]:
    """Every TCP and TCP6 socket in LISTEN state held by one of `pids` (socket inode -> owning fd)."""
    listening: dict[str, str] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                listening[fields[9]] = fields[1]   # inode -> local address
    found = []
    for pid in pids:
        name = " ".join(command_line(pid)).strip()
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue   # exited meanwhile
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in listening:
                found.append(Listener(pid, name, *decode_address(listening[inode])))
    return sorted(set(found), key=lambda s: (s.pid, s.port))


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (zombies count as gone)."""
    return [pid for pid in pids if running(pid)]


def start_cli(*args: str, log: Path, **env: str) -> subprocess.Popen:
    """`python -m deployments.cli serve ARGS` on loopback (with `env` set), its output in `log`, in its own
    process group."""
    env = {**os.environ, **LOCAL_RAY_ENV, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **env}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop_tree(proc: subprocess.Popen, pids: list[int]) -> None:
    """Clean-up after a test: a CLI still running is asked to stop first (SIGTERM: it stops its Ray and removes
    that Ray's temp dir, which a kill leaves in /tmp, e.g. after a `-k` run without the module's SIGTERM test);
    then whatever of it and the processes it started still runs is killed, by pid."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        wait_exit(proc, STOP_GRACE_S)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    for pid in alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def default_ray_sessions(pid: int) -> list[Path]:
    """Session dirs that `pid` created under Ray's default temp dir (`ray.init()` without `_temp_dir`, e.g. Ray's
    auto-init after a shutdown): none of our processes may start a Ray there."""
    return sorted(Path("/tmp/ray").glob(f"session_*_{pid}"))


def wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int | None, float]:
    """(exit status or None if it still runs after `timeout`, seconds waited)."""
    start = time.monotonic()
    try:
        return proc.wait(timeout), time.monotonic() - start
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start
