"""benchmarks/replica_cpu.py, the fleet benchmark's CPU quota per replica: what it moves and what it refuses."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.replica_cpu import ReplicaQuota, available, descendants


def test_a_replica_is_its_process_and_every_process_below_it():
    # a child that starts a grandchild, as a replica starts its engine process
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
           "print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        below = descendants(os.getpid())
        assert below[0] == os.getpid() and child.pid in below and len(below) >= 3
        assert os.getpid() not in descendants(child.pid)
    finally:
        for pid in descendants(child.pid)[::-1]:
            os.kill(pid, 9)
        child.wait()


def test_bad_quotas_are_refused_naming_why():
    why = available()
    if why is None:
        with pytest.raises(ValueError, match=r"replica cores must be in \[0.01"):
            ReplicaQuota(["app"], cores=0)
    else:
        with pytest.raises(RuntimeError, match="--replica-cpus needs CPU quotas"):
            ReplicaQuota(["app"], cores=0.5)
