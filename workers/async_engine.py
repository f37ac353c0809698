"""AsyncLLMEngine: the engine's async front, over one engine core client (workers/core_client.py).

The front tokenizes prompts (workers/tokenizer.py, a thread of its own), keeps each request's stream of token
deltas and decodes their text in front of the core, by each request's reader (workers/output.py). The core
runs behind an `EngineCoreClient`: on a step thread of this process (`ThreadCoreClient`) or in a process of
its own (`ProcessCoreClient`, workers/engine_process.py, a replica's default); the front is the same either way
and is the client's `CoreSink`.

Every accepted request ends: with a finished output, an aborted one, a `RequestError` (the engine failed it,
e.g. its adapter could not be loaded) or an `EngineDeadError` (the core's step loop crashed, its process died
or it was closed; the engine is then unhealthy and every pending stream and call gets the error).
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from contextlib import aclosing
from typing import TYPE_CHECKING, AsyncIterator, Callable

from workers.config import SamplingParams
from workers.core_client import EngineCoreClient, ThreadCoreClient
from workers.errors import EngineDeadError, RequestError
from workers.grammar import StructuredSpec
from workers.output import RequestState
from workers.request import EngineRequest, build_request
from workers.sequence import RequestOutput, TokenDelta
from workers.tokenizer import PromptEncoder, load_tokenizer

if TYPE_CHECKING:   # the engine (torch) is loaded by whoever builds one: a replica whose engine runs in a
    from workers.core import EngineCore   # process of its own never imports it
    from workers.engine import Prompt


class RequestStream:
    """The channel of one request's outputs: deltas not read yet, handed from the step thread (the client's
    sink) to the reader's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: list[TokenDelta] = []
        self.error: BaseException | None = None
        self.ended = False
        self.ready = asyncio.Event()

    def put(self, item: TokenDelta | BaseException) -> None:
        """Runs on the event loop. An error or a finished delta is final: nothing comes after it."""
        if self.ended:
            return
        if isinstance(item, BaseException):
            self.error, self.ended = item, True
        else:
            self.pending.append(item)
            self.ended = item.finished
        self.ready.set()

    def call_threadsafe(self, fn: Callable, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the caller's loop is closed: nobody is reading any more
            pass

    def put_threadsafe(self, item: TokenDelta | BaseException) -> None:
        self.call_threadsafe(self.put, item)

    async def get(self) -> list[TokenDelta]:
        """Every delta since the last call (at least one); an error at once (what it cut short is moot)."""
        await self.ready.wait()
        self.ready.clear()
        if self.error is not None:
            raise self.error
        items, self.pending = self.pending, []
        return items


class AsyncLLMEngine:
    def __init__(self, core: EngineCoreClient | EngineCore):
        """`core`: a client, or an EngineCore (an LLMEngine too) to step on a thread of this process."""
        self.client = core if isinstance(core, EngineCoreClient) else ThreadCoreClient(core)
        facts = self.client.facts
        self.encoder = PromptEncoder(facts.model_path, facts.max_model_len, facts.tokenizer_class)
        # readers' only (their incremental text, token names)
        self.decode_tokenizer = load_tokenizer(facts.model_path, facts.tokenizer_class)
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self.client.connect(self)

    @property
    def max_model_len(self) -> int:
        return self.client.facts.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.facts.vocab_size

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
            await self.client.add(request)
            added = True
            while not state.finished:
                stopped = False
                for item in await stream.get():
                    stopped = state.update(item) or stopped
                if stopped:   # a stop string: the engine stops generating it (a token or two may still come)
                    self.client.release(request_id)
                    ended = True
                if state.finish_reason == "error":
                    raise RequestError(state.error or f"request {request_id!r} failed")
                yield state.output(delta)
            ended = True
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if added and not ended and self._dead is None:
                self.client.release(request_id)   # the reader left: free its KV and adapter

    async def check_grammar(self, spec: StructuredSpec) -> None:
        """Compile a structured-output spec (cached by spec, on the grammar thread); an invalid one raises."""
        await self.client.compile_grammar(spec)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its reader gets a last output with finish_reason 'abort'."""
        await self.client.abort(request_id)
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_threadsafe(TokenDelta(request_id, [], [], "abort"))

    async def load_adapter(self, name: str, source: str, pinned: bool = False) -> str:
        return await self.client.load_adapter(name, source, pinned)

    async def unload_adapter(self, name: str) -> None:
        await self.client.unload_adapter(name)

    async def list_adapters(self) -> dict[str, str]:
        return await self.client.list_adapters()

    async def prefetch_adapters(self, names: list[str], replace: list[str] = ()) -> list[str]:
        return await self.client.prefetch_adapters(names, replace)

    async def stats(self) -> dict:
        return await self.client.stats()

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine is dead; None while it runs."""
        return self._dead

    def is_healthy(self) -> bool:
        """The core runs (cheap: no I/O, fine on an event loop)."""
        return self._dead is None and self.client.is_healthy()

    async def check_health(self) -> bool:
        return self.is_healthy() and await self.client.check_health()

    def close(self) -> None:
        """Stop the core; pending requests and calls get EngineDeadError."""
        self.client.close()
        self.encoder.close()

    # ---- the client's sink (its threads) -----------------------------------------------------------
    def outputs(self, deltas: list[TokenDelta]) -> None:
        """Each delta to its request's stream, on the stream's event loop: one wake-up of each callers' loop
        a step (a replica's streams all read on one), not one a token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenDelta]]] = {}
        with self._streams_lock:
            for out in deltas:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, out))
        for items in by_loop.values():
            items[0][0].call_threadsafe(_put_each, items)

    def lost(self, request_ids: list[str]) -> None:
        """Safety net: the core is idle yet these requests never ended; end them rather than hang."""
        with self._streams_lock:
            streams = [(rid, self._streams.get(rid)) for rid in request_ids]
        for rid, stream in streams:
            if stream is not None:
                stream.put_threadsafe(RequestError(f"request {rid!r} ended in the engine without an output"))

    def dead(self, error: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = error
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put_threadsafe(error)


def _put_each(items: list[tuple[RequestStream, TokenDelta]]) -> None:
    for stream, out in items:
        stream.put(out)
