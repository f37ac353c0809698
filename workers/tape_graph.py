"""Graph capture emulated on the CPU: an op tape recorded under a dispatch mode, replayed on the same tensors.

`TapeGraph` has the shape of the `torch.cuda.CUDAGraph` API the GraphRunner uses: `graph(tape, pool)` is the
capture context (as `torch.cuda.graph`), `replay()`, `pool()`. Capturing records every op that reaches the
dispatcher (aten ops and the custom ops, e.g. loraserve::bgmv_add / loraserve::decode_attention, which are
recorded as one op each: the mode is off inside them) with its arguments, running it as usual. Replay runs the
tape again on the very same tensor objects:

- the inputs are whatever the capture read: the static buffers (written in place before each replay), the
  weights, the KV cache, the LoRA slots;
- every tensor an op allocated during capture is kept by the tape (allocations are static, as in a graph's
  memory pool), and replay writes each op's fresh result into it in place, so the tensors the capture returned
  (the logits) are the replay's outputs and every later op reads this replay's values;
- views (outputs sharing an input's storage) need no work: they alias tensors the tape updates; in-place ops
  and `out=` ops re-run on their own targets.

As on a device, a host read during capture raises `CaptureError`: `_local_scalar_dense` (`.item()`, `bool()`,
`int()`), `Tensor.tolist()` / `Tensor.numpy()` (which read the data without an op), and ops whose output shape
depends on data (nonzero, masked_select, boolean indexing, unique, repeat_interleave with a tensor...). On the
CPU `.cpu()` of a CPU tensor is no copy, so that one a device capture would also refuse cannot be seen here.

What replay cannot reproduce, a graph would not either: Python control flow is frozen at capture, shapes are
the captured ones. Replay costs one dispatch per op plus one copy per freshly allocated output.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_STATIC_INDEXING = {torch.ops.aten.index.Tensor}   # tagged dynamic for boolean indices only: checked per call
_BOOL = (torch.bool, torch.uint8)


class CaptureError(RuntimeError):
    """An op that reads device data on the host, or sizes its output from it, ran during capture."""


class _Pool:
    """What `pool()` hands out and `graph(..., pool=...)` takes. Every tape keeps its own tensors (no reuse
    between graphs), so sharing one changes nothing: it is there to keep the GraphRunner's code one path."""


def _storage(t: torch.Tensor) -> int | None:
    if t.layout != torch.strided or t.numel() == 0:
        return None
    return t.untyped_storage().data_ptr()


def _check(func, args, kwargs) -> None:
    if not any(tag in func.tags for tag in _TAGS):
        return
    if func in _STATIC_INDEXING:
        flat, _ = tree_flatten((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.dtype in _BOOL for t in flat[1:]):
            return
    raise CaptureError(f"{func.name()} during graph capture: it reads tensor data on the host or sizes its "
                       "output from it, which a captured graph cannot do (keep the decode step free of host "
                       "syncs and data-dependent shapes)")


class _Entry:
    __slots__ = ("func", "args", "kwargs", "copies")

    def __init__(self, func, args, kwargs, copies):
        self.func, self.args, self.kwargs, self.copies = func, args, kwargs, copies

    def run(self) -> None:
        out = self.func(*self.args, **self.kwargs)
        if self.copies:
            outputs, _ = tree_flatten(out)
            for i, target in self.copies:
                target.copy_(outputs[i])


class _Recorder(TorchDispatchMode):
    def __init__(self, tape: list):
        super().__init__()
        self.tape = tape

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No: nothing here is compiled, and torch would otherwise wrap __torch_dispatch__ in _disable_dynamo, whose
        first call imports torch._dynamo (1.1 s of a CPU decode graph's first capture)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _check(func, args, kwargs)
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func, args, kwargs, out) -> None:
        inputs, _ = tree_flatten((args, kwargs))
        aliased = {_storage(t) for t in inputs if isinstance(t, torch.Tensor)} - {None}
        outputs, _ = tree_flatten(out)
        # fresh outputs get this replay's values copied in; outputs sharing an input's storage (views,
        # in-place and out= targets) are updated by the op itself or by the op that produced their base
        copies = []
        for i, t in enumerate(outputs):
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            if t.layout != torch.strided:
                raise CaptureError(f"{func.name()} during graph capture made a {t.layout} tensor, which a tape "
                                   "cannot refill in place")
            if _storage(t) not in aliased:
                copies.append((i, t))
        if copies or func._schema.is_mutable:
            self.tape.append(_Entry(func, args, kwargs, tuple(copies)))


class TapeGraph:
    """A recorded op tape standing in for a device graph (see the module docstring)."""

    def __init__(self):
        self._tape: list[_Entry] = []
        self._pool = None
        self.captured = False

    def pool(self):
        return self._pool

    @property
    def num_ops(self) -> int:
        return len(self._tape)

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("TapeGraph.replay() before a capture")
        with torch.inference_mode():
            for entry in self._tape:
                entry.run()

    def reset(self) -> None:
        self._tape, self.captured = [], False


_capturing = threading.local()


def _refuse(name: str, original):
    def method(self, *args, **kwargs):
        if getattr(_capturing, "active", False):
            raise CaptureError(f"Tensor.{name}() during graph capture: a host read of tensor data")
        return original(self, *args, **kwargs)
    method.__name__ = name
    return method


_patch_lock = threading.Lock()
_patch_depth = 0
_ORIGINALS = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}


@contextlib.contextmanager
def _refuse_host_reads():
    """tolist / numpy read a CPU tensor's memory without any op: refused on the capturing thread only."""
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            for name, original in _ORIGINALS.items():
                setattr(torch.Tensor, name, _refuse(name, original))
        _patch_depth += 1
    _capturing.active = True
    try:
        yield
    finally:
        _capturing.active = False
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                for name, original in _ORIGINALS.items():
                    setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def graph(tape: TapeGraph, pool=None):
    """Capture into `tape` (as `torch.cuda.graph(g, pool=pool)`); the ops also run, so outputs hold values."""
    if getattr(_capturing, "active", False):
        raise CaptureError("nested graph capture")
    tape.reset()
    tape._pool = pool if pool is not None else _Pool()
    recorded: list[_Entry] = []
    with _refuse_host_reads(), _Recorder(recorded):
        yield tape
    tape._tape, tape.captured = recorded, True
