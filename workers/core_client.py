"""The engine core behind one client interface, and its client on a thread of this process.

The core is workers/core.py's EngineCore: scheduler, executor and step loop; it takes `EngineRequest`s (token ids, sampling
parameters, adapter) and gives `TokenDelta`s (token ids, logprobs, finish reasons), no strings. Its front
(workers/async_engine.py: tokenizers, the requests' streams, text) holds an `EngineCoreClient` and never the
core itself, whichever way the core runs:
- `ThreadCoreClient` (here): the core on a step thread of this process;
- `ProcessCoreClient` (workers/engine_process.py): the core in a child process (a replica's default), which
  runs a `ThreadCoreClient` of its own (workers/engine_process.py's child) and sends its outputs over a socket.

Only the step thread touches the core: callers hand it commands (add, abort, adapter load/unload, stats)
through a queue and await their result, so the core needs no locks and a step is never interleaved with a
mutation. The step thread only schedules and runs the model: prompts are tokenized before they reach it,
adapter files are read on the adapter cache's load threads, grammars compile on the grammar thread.

What a client gives back goes to its `CoreSink` (the front, or the child's socket): each step's deltas, the
requests the core lost (idle yet never ended: a safety net), and its death (`EngineDeadError`: the step loop
crashed, the process died or the client was closed). After its death every call raises that error.
"""
from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from lora.errors import AdapterLoadTimeoutError
from workers.errors import EngineDeadError
from workers.grammar import StructuredSpec
from workers.request import EngineRequest
from workers.sequence import TokenDelta
from workers.tokenizer import tokenizer_class_of

if TYPE_CHECKING:   # torch: loaded only by the process that runs the core
    from workers.core import EngineCore

BUSY_WAIT_S = 0.001   # pause when work exists but nothing could run (an adapter is loading)


class CoreSink(Protocol):
    """Where a client's outputs go; called from the client's threads."""

    def outputs(self, deltas: list[TokenDelta]) -> None: ...

    def lost(self, request_ids: list[str]) -> None: ...

    def dead(self, error: EngineDeadError) -> None: ...


@dataclass(frozen=True)
class CoreFacts:
    """What the front needs of the core to tokenize and check requests."""
    model_path: str
    max_model_len: int
    vocab_size: int
    tokenizer_class: str

    @classmethod
    def of(cls, engine: EngineCore) -> CoreFacts:
        runtime = engine.runtime
        return cls(runtime.model_path, runtime.max_model_len, runtime.hf_config.vocab_size,
                   tokenizer_class_of(engine.tokenizer))


class EngineCoreClient(abc.ABC):
    facts: CoreFacts

    @abc.abstractmethod
    def connect(self, sink: CoreSink) -> None:
        """Start sending outputs to `sink` (once, before the first request)."""

    @abc.abstractmethod
    async def add(self, request: EngineRequest) -> None:
        """Queue a request (its grammar compiled first: an invalid one raises here, unqueued)."""

    @abc.abstractmethod
    def release(self, request_id: str) -> None:
        """Stop a request and free its KV and adapter, not waiting (its reader has what it wants)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request; returns once the core dropped it."""

    @abc.abstractmethod
    async def compile_grammar(self, spec: StructuredSpec) -> None:
        """Compile a structured-output spec (cached by spec); an invalid one raises."""

    @abc.abstractmethod
    async def load_adapter(self, name: str, source: str, pinned: bool = False) -> str: ...

    @abc.abstractmethod
    async def unload_adapter(self, name: str) -> None: ...

    @abc.abstractmethod
    async def list_adapters(self) -> dict[str, str]: ...

    @abc.abstractmethod
    async def prefetch_adapters(self, names: list[str], replace: list[str] = ()) -> list[str]: ...

    @abc.abstractmethod
    async def stats(self) -> dict: ...

    @abc.abstractmethod
    def is_healthy(self) -> bool:
        """Cheap (no I/O): the step loop (and its process) runs."""

    @abc.abstractmethod
    async def check_health(self) -> bool:
        """The core and its workers answer."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the core; pending calls and streams get EngineDeadError."""


class ThreadCoreClient(EngineCoreClient):
    """The core stepped by a thread of this process; commands through a queue."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.facts = CoreFacts.of(engine)
        self._sink: CoreSink | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._active: set[str] = set()   # added and not yet seen finished; step thread only
        self._stopping = False
        self._dead: EngineDeadError | None = None
        self._thread = threading.Thread(target=self._run, name="llm-engine-step", daemon=True)

    def connect(self, sink: CoreSink) -> None:
        self._sink = sink
        self._thread.start()

    # ---- callers' side (any event loop) ------------------------------------------------------------
    async def add(self, request: EngineRequest) -> None:
        await self._call(self._add, request, await self._grammar(request.params.structured))

    def release(self, request_id: str) -> None:
        self._submit(self._drop, request_id)

    async def abort(self, request_id: str) -> None:
        await self._call(self._drop, request_id)

    async def compile_grammar(self, spec: StructuredSpec) -> None:
        await self._grammar(spec)

    async def _grammar(self, spec: StructuredSpec | None):
        return None if spec is None else await asyncio.wrap_future(self.engine.grammars.compile(spec))

    async def load_adapter(self, name: str, source: str, pinned: bool = False) -> str:
        """Read the files on the adapter load threads (bounded by adapter_load_timeout_s), then register the
        adapter on the step thread: requests for other adapters keep generating meanwhile."""
        manager = self.engine.adapters
        if manager is None:
            return await self._call(self.engine.load_adapter, name, source, pinned)   # raises: LoRA is off
        timeout = self.engine.config.adapter_load_timeout_s
        try:
            preloaded = await asyncio.wait_for(asyncio.wrap_future(manager.read(name, source)), timeout)
        except TimeoutError:
            raise AdapterLoadTimeoutError(f"adapter {name!r}: reading it took longer than {timeout:g}s "
                                          f"(adapter_load_timeout_s)") from None
        return await self._call(self.engine.load_adapter, name, source, pinned, preloaded)

    async def unload_adapter(self, name: str) -> None:
        await self._call(self.engine.unload_adapter, name)

    async def list_adapters(self) -> dict[str, str]:
        return await self._call(self.engine.list_adapters)

    async def prefetch_adapters(self, names: list[str], replace: list[str] = ()) -> list[str]:
        return await self._call(self.engine.prefetch_adapters, names, replace)

    async def stats(self) -> dict:
        return await self._call(self.engine.stats)

    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    async def check_health(self) -> bool:
        """The step loop runs and the core's workers answer (a ping, off the event loop and off the step
        thread: a step stuck in a collective must not hide a dead peer)."""
        return self.is_healthy() and await asyncio.to_thread(self.engine.is_healthy)

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.engine.close()

    async def _call(self, fn: Callable, *args) -> Any:
        return await asyncio.wrap_future(self._submit(fn, *args))

    def _submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            future.set_exception(self._dead)
            return future
        self._commands.put((fn, args, future))
        self._wake.set()
        if self._dead is not None:   # died between the check and the put: the loop won't drain it
            self._fail_commands(self._dead)
        return future

    # ---- step thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        idle_steps = 0
        try:
            while not self._stopping:
                self._run_commands()
                # `_active` too: an error found while scheduling is reported by the step after it,
                # when the engine may already say it has no unfinished work.
                if not (self.engine.has_unfinished() or self._active):
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outputs = self.engine.step_deltas()
                self._active.difference_update(out.request_id for out in outputs if out.finished)
                self._sink.outputs(outputs)
                # two empty steps with nothing unfinished: whatever is still active was lost
                idle_steps = 0 if outputs or self.engine.has_unfinished() else idle_steps + 1
                if idle_steps >= 2 and self._active:
                    lost, self._active = list(self._active), set()
                    self._sink.lost(lost)
                if not outputs:
                    self._wake.wait(BUSY_WAIT_S)
                    self._wake.clear()
            self._die(EngineDeadError("the engine was closed"))
        except BaseException as exc:  # noqa: BLE001  (any crash must reach every waiting caller)
            self._die(EngineDeadError(f"the engine step loop crashed: {exc!r}"), cause=exc)

    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # noqa: BLE001  (the caller's error, raised in the caller)
                future.set_exception(exc)

    def _add(self, request: EngineRequest, grammar=None) -> None:
        self._active.add(self.engine.add(request, grammar))

    def _drop(self, request_id: str) -> None:
        self._active.discard(request_id)
        self.engine.abort(request_id)

    def _die(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        error.__cause__ = cause
        self._dead = error
        self._fail_commands(error)
        self._sink.dead(error)

    def _fail_commands(self, error: BaseException) -> None:
        while True:
            try:
                _, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
