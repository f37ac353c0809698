"""Builds and loads the repo's small C kernels (lora/backends/cpu_sgmv.c, workers/cpu_attention.c; their headers).

Plain C, no torch headers: the system C compiler builds one in about a second, on first use,
into `.cache/kernels/` of the checkout (installed: ~/.cache/loraserve/kernels; or
LORASERVE_KERNEL_DIR), keyed by the source, the headers it includes, the flags and the CPU. `-fopenmp` links libgomp.so.1, which resolves to the copy torch has already
loaded: a kernel's threads are torch's own pool (a pool of its own would fight torch's
spinning workers for the cores). If there is no compiler, or LORASERVE_CPU_KERNEL=0, `load`
returns None, a warning says why, and the callers use torch ops (same results, slower).
LORASERVE_KERNEL_ARCH builds for another -march than the machine's (tests use it to run the
code paths of CPUs without AVX-512 or its bf16 instructions).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import mmap
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch  # (loaded first: the kernels' libgomp.so.1 must resolve to torch's)
from torch.utils._python_dispatch import _get_current_dispatch_mode

logger = logging.getLogger(__name__)


def constant_result(fn):
    """torch.compiler.assume_constant_result, without its cost: the public decorator imports torch._dynamo (about
    1 s of CPU) only to set this attribute, which dynamo reads when it traces (torch/_dynamo/decorators.py; torch
    marks its own justknobs_check the same way). Every process that imports a kernel (each replica, rank and
    CLI) paid that second at start; none of them compiles."""
    fn._dynamo_marked_constant = True
    return fn


FLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast", "-shared", "-fPIC")
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_lock = threading.Lock()
_loaded: dict[Path, ctypes.CDLL | None] = {}


def _cache_dir() -> Path:
    configured = os.environ.get("LORASERVE_KERNEL_DIR")
    if configured:
        return Path(configured)
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").exists() and os.access(checkout, os.W_OK):   # a source checkout
        return checkout / ".cache" / "kernels"
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")   # an installed package
    return user_cache / "loraserve" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _sources(source: Path) -> list[bytes]:
    """The source and every local header it includes (`#include "..."`, recursively), each once: a change to any
    of them rebuilds the kernel."""
    seen, todo, texts = set(), [source.resolve()], []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_bytes()
        texts.append(text)
        todo.extend((path.parent / name.decode()).resolve() for name in _INCLUDE.findall(text))
    return texts


def _build(source: Path) -> Path:
    flags = (*FLAGS, f"-march={os.environ.get('LORASERVE_KERNEL_ARCH', 'native')}")
    parts = (*_sources(source), " ".join(flags).encode(), platform.machine().encode(), _cpu_flags().encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{key}.so"
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
        subprocess.run([compiler, *flags, str(source), "-o", partial], check=True, capture_output=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load(source: Path, symbols: dict[str, list]) -> ctypes.CDLL | None:
    """The built library with `symbols` (name -> argtypes, returning int) set up, or None (warned once)."""
    with _lock:
        if source in _loaded:
            return _loaded[source]
        lib = None
        if os.environ.get("LORASERVE_CPU_KERNEL", "1") != "0":
            try:
                lib = ctypes.CDLL(str(_build(source)))
                for name, argtypes in symbols.items():
                    fn = getattr(lib, name)
                    fn.restype, fn.argtypes = ctypes.c_int, argtypes
            except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
                detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")
                logger.warning("CPU kernel %s unavailable, using torch ops: %s %s", source.name, exc, detail)
                lib = None
        _loaded[source] = lib
        return lib


def huge_page_copy(w: torch.Tensor) -> torch.Tensor:
    """w copied into an anonymous private mapping that asks Linux for transparent huge pages (MADV_HUGEPAGE),
    advised before the copy faults its pages in; w itself where the platform has no MADV_HUGEPAGE. For the weights
    a kernel streams at decode (the MoE experts, the W8A8 linears): with THP in its usual `madvise` mode no tensor
    is backed by huge pages otherwise, and a read of 4 KiB pages stalls on their page walks: 10-25% of the MoE
    experts' time (results/moe_grouped.md), ~15% of the W8A8 linears' in a batch-1 step (results/w8a8_fused.md)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not w.is_cpu or w.numel() == 0:
        return w
    return huge_page_zeros(w.shape, w.dtype).copy_(w)


def huge_page_zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU in a mapping advised as huge_page_copy's, without a second copy in
    memory at any time (the slot pool's expert buffers can be most of the host memory: lora/slots.py); plain zeros
    where the platform has no MADV_HUGEPAGE."""
    numel = 1
    for n in shape:
        numel *= n
    size = numel * torch.empty(0, dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or size == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # zero-filled by the kernel
    buffer.madvise(mmap.MADV_HUGEPAGE)   # a hint: the kernel may still use small pages (then as before)
    # frombuffer keeps the mapping alive as long as the tensor
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def eager() -> bool:
    """Whether a kernel wrapper may call its C function directly: no dispatch mode (a captured decode's tape,
    FakeTensor) and no torch.compile trace, which must see the registered op instead. The custom op's Python
    dispatch costs about as much as a kernel at decode sizes."""
    return _get_current_dispatch_mode() is None and not torch.compiler.is_compiling()


def library(source: Path, symbols: dict[str, list], ready=lambda lib: True):
    """A kernel module's (load, available): `load()` the library once per process (called on every layer's call:
    the lookup must cost nothing), None when it did not build or `ready(lib)` is false; `available()` a fact of
    the process that torch.compile need not trace."""
    @functools.cache
    def load_once() -> ctypes.CDLL | None:
        lib = load(source, symbols)
        return lib if lib is not None and ready(lib) else None

    @constant_result
    def available() -> bool:
        return load_once() is not None
    return load_once, available
