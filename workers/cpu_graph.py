"""Decode on the CPU captured as kernel programs: the step's C kernel calls replayed back to back from C.

An eager CPU decode step spends ~3 ms of Python around its kernels (the bench checkpoint, 8 layers, 74 kernel
calls, 2 threads: a forward of ~15 ms at batch 1 whose kernel calls alone run in ~12, ~19 of ~16 at batch 32;
benchmarks/RESULTS.md, eleventh session). As a device graph does, a `CPUGraph` captures one forward on the
GraphRunner's static buffers and replays it:

- a captured op of ours (loraserve::*) whose implementation runs nothing but its kernels (allocations, views and
  `native.call`s; `native.recordable` watches it) becomes its kernel calls: each call's function and argument
  struct are fixed for the bucket (the inputs are the static buffers, the weights, the KV cache; the outputs
  were allocated at capture and are kept), so a run of consecutive calls replays as one `run_program` call
  (workers/cpu_program.c);
- every other op (the embedding; a linear oneDNN runs, an op with torch work inside) is replayed by the
  dispatcher as workers/tape_graph.py does, on the same tensors.

The rules of tape_graph hold: a host read during capture raises CaptureError, shapes and Python control flow
are frozen at capture. A kernel's nonzero status on replay raises the error its eager call raises.
GraphRunner (graph_runner.py) captures one per (batch bucket, LoRA tier), lazily, at TP 1; the steps it does
not cover (prefill, TP > 1, `enforce_eager`, models whose layers run torch ops) run eagerly as before.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections import defaultdict
from pathlib import Path

import torch

from lora import native
from workers import tape_graph

SOURCE = Path(__file__).with_name("cpu_program.c")
# Replays add each kernel call's time to its program's counters (CPUGraph.kernel_seconds): the decode profiles'
# switch (benchmarks/profile_decode.py), off in serving (two clock reads a call).
PROFILE = False
_load, available = native.library(SOURCE, {"run_program": [ctypes.c_void_p]})


class _ProgramArgs(ctypes.Structure):
    """program of cpu_program.c, field for field."""
    _fields_ = [("n", ctypes.c_int64), ("fns", ctypes.c_void_p), ("args", ctypes.c_void_p),
                ("failed", ctypes.c_void_p), ("ns", ctypes.c_void_p)]


class _Kernels:
    """A captured op replayed as its kernel calls; holds what they read and write."""
    __slots__ = ("calls", "keep")

    def __init__(self, calls, keep):
        self.calls, self.keep = calls, keep


class _Program:
    """Consecutive kernel calls, run by one run_program call."""

    def __init__(self, calls: list[native.KernelCall]):
        n = len(calls)
        self.calls = calls
        self.fns = (ctypes.c_void_p * n)(*(ctypes.cast(c.fn, ctypes.c_void_p).value for c in calls))
        self.args = (ctypes.c_void_p * n)(*(ctypes.addressof(c.args) for c in calls))
        self.failed = ctypes.c_int64(-1)
        self.ns = (ctypes.c_int64 * n)()
        self.plain = _ProgramArgs(n, ctypes.addressof(self.fns), ctypes.addressof(self.args),
                                  ctypes.addressof(self.failed), None)
        self.timed = _ProgramArgs(n, ctypes.addressof(self.fns), ctypes.addressof(self.args),
                                  ctypes.addressof(self.failed), ctypes.addressof(self.ns))

    def run(self, timed: bool = False) -> None:
        status = _load().run_program(ctypes.addressof(self.timed if timed else self.plain))
        if status:
            self.calls[self.failed.value].check(status)


class _Recorder(tape_graph._Recorder):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "loraserve":
            return super().__torch_dispatch__(func, types, args, kwargs)
        with native.recording() as seen:
            out = func(*args, **kwargs)
        if seen.calls and not seen.torch_ops:
            self.tape.append(_Kernels(seen.calls, (args, kwargs, out, seen.allocated)))
        else:
            self.record(func, args, kwargs, out)
        return out


class CPUGraph:
    """A forward captured by `graph`, replayed by `replay()`."""

    def __init__(self):
        self.steps: list = []         # _Program or tape_graph._Entry, in order
        self.kept: list[_Kernels] = []

    @property
    def num_kernel_calls(self) -> int:
        return sum(len(s.calls) for s in self.steps if isinstance(s, _Program))

    @property
    def num_torch_ops(self) -> int:
        return sum(1 for s in self.steps if not isinstance(s, _Program))

    def replay(self) -> None:
        with torch.inference_mode():
            for step in self.steps:
                if isinstance(step, _Program):
                    step.run(PROFILE)
                else:
                    step.run()

    def reset_times(self) -> None:
        for step in self.steps:
            if isinstance(step, _Program):
                ctypes.memset(step.ns, 0, ctypes.sizeof(step.ns))

    def kernel_seconds(self) -> dict[str, float]:
        """Seconds spent in each kernel (by symbol) over the replays run with PROFILE on."""
        total = defaultdict(float)
        for step in self.steps:
            if isinstance(step, _Program):
                for c, ns in zip(step.calls, step.ns):
                    total[c.fn.__name__] += ns / 1e9
        return dict(total)

    def _build(self, tape: list) -> None:
        calls: list[native.KernelCall] = []
        for entry in tape:
            if isinstance(entry, _Kernels):
                calls += entry.calls
                self.kept.append(entry)
                continue
            if calls:
                self.steps.append(_Program(calls))
                calls = []
            self.steps.append(entry)
        if calls:
            self.steps.append(_Program(calls))


@contextlib.contextmanager
def graph(g: CPUGraph):
    """Capture into g (as torch.cuda.graph(g)); the ops also run, so the outputs hold this forward's values."""
    tape: list = []
    with tape_graph._refuse_host_reads(), _Recorder(tape):
        yield g
    g._build(tape)
