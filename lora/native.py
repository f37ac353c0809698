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

import contextlib
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
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch  # (loaded first: the kernels' libgomp.so.1 must resolve to torch's)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

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


class KernelCall(NamedTuple):
    """One kernel call as a captured CPU decode step records it (workers/cpu_graph.py): the ctypes function, its
    argument struct (kept alive by the record) and the status check that raises the call's own error."""
    fn: ctypes._CFuncPtr
    args: ctypes.Structure
    check: Callable[[int], None]


_recording = threading.local()


def call(fn, args: ctypes.Structure, check: Callable[[int], None]) -> None:
    """fn(&args), a kernel taking one argument struct; a nonzero status goes to check (which raises). Under
    `recording` the call is also recorded."""
    state = getattr(_recording, "state", None)
    if state is not None:
        state.calls.append(KernelCall(fn, args, check))
    status = fn(ctypes.addressof(args))
    if status:
        check(status)


_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default}
_METADATA = {torch.ops.mkldnn.data_ptr.default, torch.ops.mkldnn._nbytes.default}


class _OnlyKernels(TorchDispatchMode):
    """Inside a recorded op: notes every tensor op that is not an allocation, a view or a packed weight's address,
    i.e. torch work a replay of the recorded kernel calls alone would skip."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    @classmethod
    def _should_skip_dynamo(cls) -> bool:   # as workers/tape_graph.py's recorder: no torch._dynamo import
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.state.allocated.append(out)
        elif not (func in _METADATA or _aliases(func, (args, kwargs), out)):
            self.state.torch_ops.append(func.name())
        return out


def _aliases(func, inputs, out) -> bool:
    """Whether the op only made views of its inputs: no mutation, tensor outputs only, each on an input's storage
    (`contiguous` of a strided tensor is marked as a view in its schema, yet copies; `item` reads a value that a
    replay would not read again)."""
    outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if func._schema.is_mutable or not outputs:
        return False
    storages = {t.untyped_storage().data_ptr() for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages for t in outputs)


class Recording:
    """What `recording` collected: the kernel calls, the tensors allocated for them, the other torch ops run."""

    def __init__(self):
        self.calls: list[KernelCall] = []
        self.allocated: list[torch.Tensor] = []
        self.torch_ops: list[str] = []


@contextlib.contextmanager
def recording():
    """Record the kernel calls (`call`) of the ops run inside, on this thread; yields the Recording."""
    _recording.state = state = Recording()
    try:
        yield state
    finally:
        _recording.state = None


def recordable(impl):
    """Wraps a kernel op's implementation (the function registered for its torch op): while `recording`, it runs
    under a mode that sees any torch work in it besides allocations and views (a replay of its kernel calls
    alone would skip that work, so workers/cpu_graph.py then replays the op itself)."""
    @functools.wraps(impl)
    def op(*args, **kwargs):
        state = getattr(_recording, "state", None)
        if state is None:
            return impl(*args, **kwargs)
        with _OnlyKernels(state):
            return impl(*args, **kwargs)
    return op


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
