"""AsyncLLMEngine: the synchronous LLMEngine driven by a background thread, with per-request async streams.

Only the step thread touches the engine: callers hand it commands (add, abort,
adapter load/unload, stats) through a queue and await their result, so the
engine needs no locks and a step is never interleaved with a mutation. The step
thread only schedules and runs the model: prompts are tokenized before they
reach it (workers/tokenizer.py, a thread of its own), adapter files are read on
the adapter cache's load threads, and text is decoded in front of it, by each
request's reader (workers/output.py). Each request's stream holds the token
deltas its reader has not taken yet.

Every accepted request ends: with a finished output, an aborted one, a
`RequestError` (the engine failed it, e.g. its adapter could not be loaded) or
an `EngineDeadError` (the step loop crashed or the engine was closed; the
engine is then unhealthy and every pending stream and command gets the error).

The callers' side (`_front`: tokenizers, streams, `generate`) asks the step thread for what it needs through
`_enqueue`, `_release`, `_drop_now` and the adapter / stats calls; workers/engine_process.py overrides exactly
those to run the step loop in a process of its own (a replica's default).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import queue
import threading
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from lora.errors import AdapterLoadTimeoutError
from workers.config import SamplingParams
from workers.errors import EngineDeadError, RequestError
from workers.grammar import StructuredSpec
from workers.request import EngineRequest, build_request
from workers.output import RequestState
from workers.sequence import RequestOutput, TokenDelta
from workers.stream import RequestStream
from workers.tokenizer import PromptEncoder, load_tokenizer, tokenizer_class_of

if TYPE_CHECKING:   # the engine (torch) is loaded by whoever builds one: a replica whose engine runs in a
    from workers.engine import LLMEngine, Prompt   # process of its own never imports it

BUSY_WAIT_S = 0.001   # pause when work exists but nothing could run (an adapter is loading)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._front(engine.runtime.model_path, engine.runtime.max_model_len, tokenizer_class_of(engine.tokenizer))
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._active: set[str] = set()   # added and not yet seen finished; step thread only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llm-engine-step", daemon=True)
        self._thread.start()

    def _front(self, model_path: str, max_model_len: int, tokenizer_class: str) -> None:
        """The callers' side: tokenizers and the requests' streams (workers/engine_process.py has only this)."""
        self.encoder = PromptEncoder(model_path, max_model_len, tokenizer_class)
        # readers' only (their incremental text, token names)
        self.decode_tokenizer = load_tokenizer(model_path, tokenizer_class)
        self._callers()

    def _callers(self) -> None:
        """The requests' streams (what failing them needs)."""
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None

    @property
    def max_model_len(self) -> int:
        return self.engine.runtime.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.runtime.hf_config.vocab_size

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict] | None = None,
                          chat_template_kwargs: dict | None = None) -> list[int]:
        """The chat template's prompt as token ids (tokenized on the tokenizer thread); `tools` as the
        template's `tools` (OpenAI's function-tool dicts), `chat_template_kwargs` as vLLM's (workers/tokenizer.py)."""
        return await self.encoder.render_chat(messages, add_generation_prompt, add_special_tokens, tools,
                                              chat_template_kwargs)

    # ---- caller side (any event loop) ---------------------------------------------------------------
    async def make_request(self, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None,
                           request_id: str | None = None) -> EngineRequest:
        """A caller's edge: the prompt tokenized (on the tokenizer thread), the request validated once
        (workers/request.py)."""
        token_ids = await self.encoder.encode(prompt) if isinstance(prompt, str) else list(prompt or [])
        return build_request(prompt, token_ids, params or SamplingParams(), adapter, request_id,
                             self.max_model_len, self.vocab_size)

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None,
                       request_id: str | None = None, delta: bool = False) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, cumulative (or, with `delta`, only what is new in each); the last one is
        finished. Leaving early aborts it."""
        request = await self.make_request(prompt, params, adapter, request_id)
        async with aclosing(self.generate_request(request, delta)) as outputs:
            async for out in outputs:
                yield out

    async def generate_request(self, request: EngineRequest, delta: bool = False) -> AsyncIterator[RequestOutput]:
        """`generate` of a request built already (`make_request`): nothing is checked again."""
        if request.request_id is None:
            request = dataclasses.replace(request, request_id=f"async-{next(self._ids)}")
        request_id, params = request.request_id, request.params
        state = RequestState(request_id, request.prompt_token_ids, params, self.decode_tokenizer, request.adapter)
        stream = RequestStream(asyncio.get_running_loop())
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream   # before it is queued, so no output can be missed
        added = ended = False
        try:
            await self._enqueue(request)
            added = True
            while not state.finished:
                stopped = False
                for item in await stream.get():
                    stopped = state.update(item) or stopped
                if stopped:   # a stop string: the engine stops generating it (a token or two may still come)
                    self._release(request_id)
                    ended = True
                if state.finish_reason == "error":
                    raise RequestError(state.error or f"request {request_id!r} failed")
                yield state.output(delta)
            ended = True
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if added and not ended and self._dead is None:
                self._release(request_id)   # the reader left: free its KV and adapter

    async def check_grammar(self, spec: StructuredSpec) -> None:
        """Compile a structured-output spec (cached by spec, on the grammar thread); an invalid one raises."""
        await self._grammar(spec)

    async def _grammar(self, spec: StructuredSpec | None):
        return None if spec is None else await asyncio.wrap_future(self.engine.grammars.compile(spec))

    async def _enqueue(self, request: EngineRequest) -> None:
        """Queue a request in the engine (its grammar compiled first: an invalid one raises here, unqueued)."""
        await self._call(self._add, request, await self._grammar(request.params.structured))

    def _release(self, request_id: str) -> None:
        """The engine stops a request and frees its KV and adapter (its reader has what it wants)."""
        self._submit(self._drop, request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its reader gets a last output with finish_reason 'abort'."""
        await self._drop_now(request_id)
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_threadsafe(TokenDelta(request_id, [], [], "abort"))

    async def _drop_now(self, request_id: str) -> None:
        await self._call(self._drop, request_id)

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

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine is dead; None while it runs."""
        return self._dead

    def is_healthy(self) -> bool:
        """The step loop runs (cheap: no I/O, fine on an event loop)."""
        return self._dead is None and self._thread.is_alive()

    async def check_health(self) -> bool:
        """The step loop runs and the engine's workers answer (a ping, off the event loop and off the step
        thread: a step stuck in a collective must not hide a dead peer)."""
        if not self.is_healthy():
            return False
        return await asyncio.to_thread(getattr(self.engine, "is_healthy", lambda: True))

    def close(self) -> None:
        """Stop the step loop; pending requests and commands get EngineDeadError."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        if hasattr(self, "encoder"):   # an engine process's child has none
            self.encoder.close()
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
                self._publish(outputs)
                # two empty steps with nothing unfinished: whatever is still active was lost
                idle_steps = 0 if outputs or self.engine.has_unfinished() else idle_steps + 1
                if idle_steps >= 2 and self._active:
                    self._fail_lost()
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
        self._active.add(self.engine.add(request, detokenize=False, grammar=grammar))

    def _drop(self, request_id: str) -> None:
        self._active.discard(request_id)
        self.engine.abort(request_id)

    def _publish(self, outputs: list[TokenDelta]) -> None:
        self._active.difference_update(out.request_id for out in outputs if out.finished)
        self._deliver(outputs)

    def _deliver(self, outputs: list[TokenDelta]) -> None:
        """Each output to its request's stream, on the stream's event loop: one wake-up of each callers' loop
        a step (a replica's streams all read on one), not one a token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenDelta]]] = {}
        with self._streams_lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for items in by_loop.values():
            items[0][0].call_threadsafe(_put_each, items)

    def _fail_lost(self) -> None:
        """Safety net: the engine is idle yet these requests never ended; end them rather than hang."""
        with self._streams_lock:
            streams = [(rid, self._streams.get(rid)) for rid in self._active]
        for rid, stream in streams:
            if stream is not None:
                stream.put_threadsafe(RequestError(f"request {rid!r} ended in the engine without an output"))
        self._active.clear()

    def _die(self, error: EngineDeadError, cause: BaseException | None = None) -> None:
        error.__cause__ = cause
        self._dead = error
        self._fail_commands(error)
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put_threadsafe(error)

    def _fail_commands(self, error: BaseException) -> None:
        while True:
            try:
                _, _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(error)


def _put_each(items: list[tuple[RequestStream, TokenDelta]]) -> None:
    for stream, out in items:
        stream.put(out)
