"""The engine process's side (started by workers/engine_process.py as `python -m workers.engine_core FD`): it
builds the EngineCore, loads the configured adapters, then steps it through a ThreadCoreClient
(workers/core_client.py) whose sink sends its outputs, lost requests and death to the replica over the socket,
and answers the replica's typed messages (workers/core_messages.py) on an event loop of its own. It exits when
the socket closes."""
from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Awaitable, Callable

from workers import core_messages as msg
from workers.core_client import CoreFacts, ThreadCoreClient
from workers.engine_process import build_engine
from workers.errors import EngineDeadError
from workers.heap import freeze_startup_heap
from workers.sequence import TokenDelta


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


def _handlers(core: ThreadCoreClient) -> dict[type, Callable[[Any], Awaitable]]:
    """Each call's message type -> what the core's client does for it (awaited on the child's loop)."""
    return {msg.AddRequest: lambda m: core.add(m.request),
            msg.AbortRequest: lambda m: core.abort(m.request_id),
            msg.CompileGrammar: lambda m: core.compile_grammar(m.spec),
            msg.LoadAdapter: lambda m: core.load_adapter(m.name, m.source, m.pinned),
            msg.UnloadAdapter: lambda m: core.unload_adapter(m.name),
            msg.ListAdapters: lambda m: core.list_adapters(),
            msg.PrefetchAdapters: lambda m: core.prefetch_adapters(list(m.names), list(m.replace)),
            msg.GetStats: lambda m: core.stats(),
            msg.CheckHealth: lambda m: core.check_health()}


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

    handlers = _handlers(core)

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
