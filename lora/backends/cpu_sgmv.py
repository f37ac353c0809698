"""The CPU segmented-LoRA kernel (cpu_sgmv.c): built with the system C compiler on first use, called by ctypes.

Plain C, no torch headers, so the build takes about a second; the shared object is cached
under `.cache/kernels/` of the checkout (or LORASERVE_KERNEL_DIR), keyed by the source, the
flags and the machine. If there is no compiler, or LORASERVE_CPU_KERNEL=0, `available()` is
False and the torch ops do the work (same results, slower with many adapters per batch).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from lora.batch import token_runs

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_sgmv.c")
# -fopenmp links libgomp.so.1, which resolves to the copy torch has already loaded: the kernel's
# threads are torch's own pool. LORASERVE_KERNEL_ARCH builds for another -march (tests use it
# to run the code paths of machines without AVX-512 or its bf16 instructions).
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC")
_SYMBOLS = {torch.bfloat16: "sgmv_add_bf16", torch.float32: "sgmv_add_f32"}
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    configured = os.environ.get("LORASERVE_KERNEL_DIR")
    if configured:
        return Path(configured)
    repo_cache = Path(__file__).resolve().parents[2] / ".cache" / "kernels"
    return repo_cache if os.access(repo_cache.parents[1], os.W_OK) else Path(tempfile.gettempdir()) / "loraserve-kernels"


def _build() -> Path:
    source = SOURCE.read_bytes()
    flags = (*FLAGS, f"-march={os.environ.get('LORASERVE_KERNEL_ARCH', 'native')}")
    key = hashlib.sha256(source + " ".join(flags).encode() + platform.machine().encode()
                         + platform.processor().encode() + _cpu_model().encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_sgmv-{key}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build into a private name, then rename: concurrent processes (Ray workers) never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, str(SOURCE), "-o", partial], check=True, capture_output=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("LORASERVE_CPU_KERNEL", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(_build()))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            logger.warning("CPU LoRA kernel unavailable, using torch ops: %s %s", exc, detail.decode(errors="replace"))
            return None
        for symbol in _SYMBOLS.values():
            fn = getattr(lib, symbol)
            fn.restype = ctypes.c_int
        _lib = lib
        return _lib


def available() -> bool:
    return (_lib if _tried else _load()) is not None


@dataclass(frozen=True)
class Groups:
    """The adapters of a batch as the kernel reads them; the tensors must outlive the call."""
    num_groups: int
    slot: torch.Tensor      # [G] int64
    rank: torch.Tensor      # [G] int64
    start: torch.Tensor     # [G + 1] int64, into rows
    rows: torch.Tensor      # token rows, grouped by adapter
    bounds: tuple[int, int, int]   # max row + 1, max slot + 1, max rank (0s when empty)


# Past this many tokens per adapter (on average) the torch GEMMs, multi-threaded, win.
KERNEL_MAX_MEAN_TOKENS = 32


@functools.lru_cache(maxsize=64)
def plan_groups(seg_lens: tuple[int, ...], seg_slots: tuple[int, ...], slot_ranks: tuple[int, ...],
                max_rank: int) -> Groups | None:
    """The batch's adapters as kernel groups, or None when the torch ops are the better choice."""
    runs = tuple((slot, min(slot_ranks[slot] if slot < len(slot_ranks) else max_rank, max_rank),
                  tuple(t for lo, hi in spans for t in range(lo, hi)))
                 for slot, spans in token_runs(seg_lens, seg_slots).items())
    runs = tuple(run for run in runs if run[1] > 0 and run[2])     # empty slots add exactly zero
    if not runs or sum(len(rows) for _, _, rows in runs) > KERNEL_MAX_MEAN_TOKENS * len(runs):
        return None
    return groups_for(runs)


@functools.lru_cache(maxsize=64)
def groups_for(runs: tuple[tuple[int, int, tuple[int, ...]], ...]) -> Groups:
    """runs: (slot, rank, token rows) per adapter present."""
    as_i64 = functools.partial(torch.tensor, dtype=torch.int64)
    start = [0]
    for _, _, rows in runs:
        start.append(start[-1] + len(rows))
    rows = [t for _, _, ts in runs for t in ts]
    bounds = (max(rows, default=-1) + 1, max((s for s, _, _ in runs), default=-1) + 1,
              max((r for _, r, _ in runs), default=0))
    return Groups(len(runs), as_i64([s for s, _, _ in runs]), as_i64([r for _, r, _ in runs]), as_i64(start),
                  as_i64(rows), bounds)


class _Args(ctypes.Structure):
    """sgmv_args of cpu_sgmv.c, field for field."""
    _fields_ = [("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64), ("in_dim", ctypes.c_int64),
                ("a", ctypes.c_void_p), ("a_slot_stride", ctypes.c_int64), ("stack", ctypes.c_int64),
                ("R", ctypes.c_int64), ("b", ctypes.POINTER(ctypes.c_void_p)),
                ("out_dims", ctypes.POINTER(ctypes.c_int64)), ("y_offsets", ctypes.POINTER(ctypes.c_int64)),
                ("y", ctypes.c_void_p), ("y_stride", ctypes.c_int64),
                ("group_slot", ctypes.c_void_p), ("group_rank", ctypes.c_void_p), ("group_start", ctypes.c_void_p),
                ("rows", ctypes.c_void_p)]


def supports(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor]) -> bool:
    """The layouts the kernel reads (anything else goes to the torch ops)."""
    return (x.device.type == "cpu" and x.dtype in _SYMBOLS and x.dtype == a.dtype == y.dtype
            and all(b_s.dtype == x.dtype and b_s.is_contiguous() for b_s in b)
            and x.dim() == 2 and x.stride(1) == 1 and y.dim() == 2 and y.stride(1) == 1
            and a.dim() == 3 and a.is_contiguous() and a.shape[2] == x.shape[1])


def sgmv_add(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: Sequence[torch.Tensor],
             offsets: Sequence[int], groups: Groups, max_rank: int) -> None:
    """y[t, offsets[s]:offsets[s+1]] += x[t] @ a[l, s*R:(s+1)*R].T @ b[s][l].T for each group's rows t, slot l."""
    lib = _load()
    assert lib is not None and supports(y, x, a, b), "call supports() / available() first"
    stack, R = len(b), max_rank
    out_dims = [b_s.shape[1] for b_s in b]
    # Everything the C code indexes is checked here: it trusts its arguments.
    if a.shape[1] != stack * R or any(b_s.shape[0] != a.shape[0] or b_s.shape[2] != R for b_s in b):
        raise ValueError(f"LoRA buffers a {tuple(a.shape)} / b {[tuple(b_s.shape) for b_s in b]} for R={R}")
    if list(offsets[1:]) != [offsets[s] + out_dims[s] for s in range(stack)] or offsets[-1] > y.shape[1]:
        raise ValueError(f"offsets {list(offsets)} do not fit out dims {out_dims} / y {tuple(y.shape)}")
    rows_end, slots_end, rank = groups.bounds
    if rows_end > min(x.shape[0], y.shape[0]) or slots_end > a.shape[0] or rank > R:
        raise ValueError("LoRA groups index past the batch, the slots or the rank")
    i64_array = lambda v: (ctypes.c_int64 * len(v))(*v)  # noqa: E731
    args = _Args(x.data_ptr(), x.stride(0), x.shape[1], a.data_ptr(), a.stride(0), stack, R,
                 (ctypes.c_void_p * stack)(*[b_s.data_ptr() for b_s in b]), i64_array(out_dims),
                 i64_array(list(offsets[:-1])), y.data_ptr(), y.stride(0), groups.slot.data_ptr(),
                 groups.rank.data_ptr(), groups.start.data_ptr(), groups.rows.data_ptr())
    status = getattr(lib, _SYMBOLS[x.dtype])(ctypes.byref(args), ctypes.c_int64(groups.num_groups))
    if status != 0:
        raise MemoryError("CPU LoRA kernel: out of memory for its scratch buffers")
