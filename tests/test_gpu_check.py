"""benchmarks/gpu_check.sh stays runnable for the day a GPU is lent: its device programs (LoRA mixed batch;
Qwen3-MoE with expert LoRA and constrained requests) run here in --dry-run, the CPU capture emulation as the
device, and must still match the CPU engine token for token."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # make test-fast skips it: the whole gpu_check.sh dry run

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_dry_run_passes_its_device_steps(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_DIR=str(tmp_path))
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    for step in ("lora_device", "moe_device"):
        assert any(line.split() == [step, "ok"] for line in done.stdout.splitlines()), done.stdout[-3000:]
