"""The engine core in a process of its own, as vLLM's EngineCore; both ends of its socket are here.

In one process the engine's step thread shares the GIL with the replica's event loop, which streams every
token of every request through Ray Serve (~0.5 ms of Python a token): under load each step waited for it.
The parent's front (AsyncLLMEngine) tokenizes, keeps the requests' streams and decodes their text, and holds
a `ProcessCoreClient`, which asks the child for everything by typed messages (workers/core_messages.py: the
calls, posts and replies). The child, this module run as `python -m workers.engine_process FD` (`_serve`),
builds the EngineCore, steps it through a ThreadCoreClient whose sink sends ("out", [TokenDelta]) a step,
("lost", [request id]) and ("dead", message) back, and answers calls on an event loop of its own. It exits when
the socket closes; the parent fails every stream and call when the child goes (EngineDeadError), so Serve's
health check replaces the replica. Only for an engine in the replica's process (TP=1, or distributed_executor
inproc): the ranks of a Ray executor are actors of their own already, and the child is no Ray worker.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from workers import core_messages as msg
from workers.async_engine import AsyncLLMEngine
from workers.config import EngineConfig
from workers.core_client import CoreFacts, CoreSink, EngineCoreClient, ThreadCoreClient
from workers.errors import EngineDeadError
from workers.grammar import StructuredSpec
from workers.heap import freeze_startup_heap
from workers.request import EngineRequest
from workers.sequence import TokenDelta

START_TIMEOUT_S = 1800.0   # a big model loads for minutes
CLOSE_TIMEOUT_S = 30.0
# glibc's malloc on transparent huge pages in the engine process: with THP in its usual `madvise` mode no tensor is
# otherwise, and a decode step streams every weight and its KV through 4 KiB page walks (benchmarks/hugepages.py,
# docs/cpu.md). glibc reads it once, at the process's start; a GLIBC_TUNABLES of the caller's own (empty: none) is kept.
MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"


def build_engine(config: EngineConfig, adapters: dict[str, str]):
    """The engine core with its configured adapters loaded (a bad one fails the start, loudly)."""
    from workers.core import EngineCore   # torch: only the process that runs the engine loads it
    engine = EngineCore(config)
    for name, source in adapters.items():
        engine.load_adapter(name, source)
    return engine


def start_engine(config: EngineConfig, adapters: dict[str, str], own_process: bool = True) -> AsyncLLMEngine:
    """An engine in a process of its own when `own_process` and it can be (`EngineConfig.runs_in_process`), else on a
    thread of this process."""
    if own_process and config.runs_in_process:
        return AsyncLLMEngine(ProcessCoreClient(config, adapters))
    return AsyncLLMEngine(ThreadCoreClient(build_engine(config, adapters)))


class ProcessCoreClient(EngineCoreClient):
    """The core in a child process (started here; adapters loaded before it is ready)."""

    def __init__(self, config: EngineConfig, adapters: dict[str, str] | None = None):
        if not config.runs_in_process:
            raise ValueError("an engine process holds an in-process engine (tensor_parallel_size=1, not "
                             "distributed_executor='ray'), not the ranks of a Ray executor")
        ours, theirs = socket.socketpair()
        env = {"GLIBC_TUNABLES": MALLOC_TUNABLES, **os.environ}
        self._proc = subprocess.Popen([sys.executable, "-m", "workers.engine_process", str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._sink: CoreSink | None = None
        self._dead: EngineDeadError | None = None
        try:
            self._send(("start", config, dict(adapters or {})))
            if not self._conn.poll(START_TIMEOUT_S):
                raise TimeoutError(f"the engine process did not start in {START_TIMEOUT_S:g}s")
            kind, *payload = self._conn.recv()
        except (EOFError, OSError):
            kind, payload = "failed", [EngineDeadError(f"the engine process exited while starting "
                                                       f"(exit code {self._proc.wait()})")]
        except BaseException:
            self._stop_child()
            raise
        if kind != "ready":
            self._stop_child()
            raise payload[0]
        self.facts: CoreFacts = payload[0]
        self._reader = threading.Thread(target=self._read, name="llm-engine-process-reader", daemon=True)

    def connect(self, sink: CoreSink) -> None:
        self._sink = sink
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    # ---- what the child does, asked by typed messages (workers/core_messages.py) --------------------
    async def add(self, request: EngineRequest) -> None:
        await self._remote(msg.AddRequest(request))

    def release(self, request_id: str) -> None:
        self._post(msg.ReleaseRequest(request_id))

    async def abort(self, request_id: str) -> None:
        await self._remote(msg.AbortRequest(request_id))

    async def compile_grammar(self, spec: StructuredSpec) -> None:
        await self._remote(msg.CompileGrammar(spec))

    async def load_adapter(self, name: str, source: str, pinned: bool = False) -> str:
        return await self._remote(msg.LoadAdapter(name, source, pinned))

    async def unload_adapter(self, name: str) -> None:
        await self._remote(msg.UnloadAdapter(name))

    async def list_adapters(self) -> dict[str, str]:
        return await self._remote(msg.ListAdapters())

    async def prefetch_adapters(self, names: list[str], replace: list[str] = ()) -> list[str]:
        return await self._remote(msg.PrefetchAdapters(tuple(names), tuple(replace)))

    async def stats(self) -> dict:
        return await self._remote(msg.GetStats())

    def is_healthy(self) -> bool:
        return self._dead is None and self._proc.poll() is None

    async def check_health(self) -> bool:
        return self.is_healthy() and await self._remote(msg.CheckHealth())

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send(("post", msg.Close()))
            except OSError:
                pass
        self._stop_child()
        if self._reader.is_alive():
            self._reader.join(timeout=CLOSE_TIMEOUT_S)

    # ---- the socket ---------------------------------------------------------------------------------
    async def _remote(self, message) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        if self._dead is not None:   # also after the put: _die fails what it finds
            self._fail_calls(self._dead)
        else:
            self._send_or_die(("call", call_id, message))
        return await asyncio.wrap_future(future)

    def _post(self, message) -> None:
        if self._dead is None:
            self._send_or_die(("post", message))

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _send_or_die(self, message: tuple) -> None:
        try:
            self._send(message)
        except OSError:
            self._die(EngineDeadError(f"the engine process is gone (exit code {self._proc.poll()})"))

    def _read(self) -> None:
        try:
            while True:
                kind, *payload = self._conn.recv()
                if kind == "out":
                    self._sink.outputs(payload[0])
                elif kind == "reply":
                    call_id, ok, value = payload
                    future = self._calls.pop(call_id, None)
                    if future is not None and future.set_running_or_notify_cancel():
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "lost":
                    self._sink.lost(payload[0])
                elif kind == "dead":
                    self._die(EngineDeadError(payload[0]))
                    return
        except (EOFError, OSError):
            code = self._proc.wait()
            self._die(EngineDeadError(f"the engine process exited (exit code {code})"))

    def _die(self, error: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = error
        self._fail_calls(error)
        self._sink.dead(error)

    def _fail_calls(self, error: BaseException) -> None:
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)

    def _stop_child(self) -> None:
        try:
            self._proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()


# ---- the child: the engine core's side of the socket ---------------------------------------------------------
class _SocketSink:
    """The child's outputs, lost requests and death, to the parent: one message each."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send

    def outputs(self, deltas: list[TokenDelta]) -> None:
        self._send(("out", deltas))

    def lost(self, request_ids: list[str]) -> None:
        self._send(("lost", request_ids))

    def dead(self, error: EngineDeadError) -> None:
        try:
            self._send(("dead", str(error)))
        except OSError:   # the parent is gone
            pass


def _serve(conn: Connection) -> None:
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    def send_safely(*message) -> None:
        """`message`, or, when its last part does not pickle (an exotic error), that part as a RuntimeError."""
        try:
            send(message)
        except (pickle.PicklingError, TypeError, AttributeError, ValueError) as exc:
            send((*message[:-1], RuntimeError(f"{message[-1]!r} ({exc})")))

    kind, config, adapters = conn.recv()
    assert kind == "start", kind
    try:
        engine = build_engine(config, adapters)
    except Exception as exc:  # noqa: BLE001  (the parent raises it)
        send_safely("failed", exc)
        return
    freeze_startup_heap()   # no full collection's pause over the model's objects while serving
    core = ThreadCoreClient(engine)
    send(("ready", CoreFacts.of(engine)))
    core.connect(_SocketSink(send))
    loop = asyncio.new_event_loop()
    tasks: set[asyncio.Task] = set()
    handlers = msg.handlers(core)

    async def call(call_id: int, message) -> None:
        try:
            send_safely("reply", call_id, True, await handlers[type(message)](message))
        except Exception as exc:  # noqa: BLE001  (the caller's error, raised in the parent)
            send_safely("reply", call_id, False, exc)

    def handle(envelope: tuple) -> None:
        if envelope[0] == "call":
            task = loop.create_task(call(*envelope[1:]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif isinstance(envelope[1], msg.Close):
            loop.stop()
        else:   # a posted ReleaseRequest
            core.release(envelope[1].request_id)

    def read() -> None:   # off the loop: a message is read whole while the loop runs calls
        try:
            while True:
                loop.call_soon_threadsafe(handle, conn.recv())
        except (EOFError, OSError):   # the parent is gone or closed the socket
            loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read, name="engine-process-reader", daemon=True).start()
    try:
        loop.run_forever()
    finally:
        core.close()


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's Ctrl-C is the parent's to handle
    _serve(Connection(int(sys.argv[1])))
    os._exit(0)   # the engine's threads (tokenizer, adapter loads) must not hold the exit
