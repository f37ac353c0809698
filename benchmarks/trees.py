"""Revisions side by side for A/B benchmarks: a git worktree per revision under .cache/ab, and a child process
that runs a benchmark's code with one tree first on the path (Ray's workers and the engines inherit it) and
prints its result as the line `RESULT <json>`. Both trees share one generated checkpoint (LORASERVE_BENCH_CACHE)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.checkpoint import cache_root

ROOT = Path(__file__).resolve().parent.parent


def checkout(rev: str) -> Path:
    """The worktree of `rev` (created on first use): .cache/ab/<sha[:12]>."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = ROOT / ".cache" / "ab" / sha[:12]
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    return tree


def revision(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or str(tree)


def alternating(trees: list[Path], pairs: int) -> list[Path]:
    """The run order a, b, b, a, a, b, ... over `pairs` rounds: neither tree always runs first on a busy machine."""
    return [tree for p in range(pairs) for tree in (trees if p % 2 == 0 else trees[::-1])]


def run_child(tree: Path, code: str, *args: str, timeout: float = 900) -> dict:
    """Run `code` (python -c) in `tree` with `args`; its last `RESULT <json>` line, parsed."""
    env = dict(os.environ, PYTHONPATH=str(tree), LORASERVE_BENCH_CACHE=str(cache_root()))
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        raise RuntimeError(f"{tree}: exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(results[-1].removeprefix("RESULT "))
