"""LLMServer: the Serve deployment holding one AsyncLLMEngine per replica.

It also renders OpenAI responses (deployments/render.py) for the HTTP ingress: `render_choices` (a
whole answer's choices) and `render_stream` (SSE events, batched per step window), so the ingress
only relays bytes. Adapters are routed with Serve's multiplexing: a caller names the adapter as
`multiplexed_model_id`, Serve prefers a replica that already holds it, and the
replica loads it on first use (from the app's adapter registry; deployments/replica_adapters.py). Handle
methods: `generate`, `generate_stream`, `load_adapter`, `unload_adapter`,
`list_adapters`, `stats`; `check_health` fails once the engine (or one of its
workers) is dead, so Serve replaces the replica (deployments/replica_health.py).
"""
from __future__ import annotations

import asyncio
import os
from contextlib import aclosing
from typing import Any, AsyncIterator

from ray import serve

from deployments.choices import best, choice, handle_call, merge, ranks
from deployments.config import LLMConfig
from deployments.errors import quiet_caller_errors
from deployments.loopback import bind_replica_grpc_to_node_ip
from deployments.metrics import ServerMetrics
from deployments.replica_adapters import ReplicaAdapters
from deployments.replica_health import ReplicaHealth
from deployments.render import RenderedChoices, RenderSpec, batched
from deployments.responses_render import RenderedResponse, ResponsesSpec
from deployments.served_output import ServedOutput
from deployments.vllm_metrics import RequestTimer
from lora.errors import AdapterNotFoundError
from lora.sources import is_hub_id
from workers.async_engine import AsyncLLMEngine
from workers.config import SamplingParams
from workers.engine_process import start_engine
from workers.heap import freeze_startup_heap
from workers.output import TokenNames
from workers.reasoning import think_tokens
from workers.request import EngineRequest, check_token_ids
from workers.sequence import RequestOutput

Prompt = str | list[int]


class LLMServer(ReplicaAdapters, ReplicaHealth):
    async def __init__(self, config: LLMConfig):
        bind_replica_grpc_to_node_ip()   # before Serve starts this replica's gRPC server (after __init__)
        quiet_caller_errors()     # a caller's mistake raised from a method is one log line, not a traceback
        self.config = config
        self._hotload_hub = config.engine_config().hub_adapters_allowed   # for callers: the hot-load roots' rule
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._use_engine(await asyncio.to_thread(_start_engine, config), config)   # minutes for a big model
        await self._start_adapters(context.app_name)
        freeze_startup_heap()   # this process's start-up objects (Ray, Serve, the engine on a thread) left alone

    def _use_engine(self, engine: AsyncLLMEngine, config: LLMConfig) -> None:
        """What the request path needs of the engine and the config (all of it, for a replica without Serve)."""
        self.engine = engine
        self._token_names = TokenNames(engine.decode_tokenizer)
        self._think = think_tokens(config.engine.reasoning_parser, engine.decode_tokenizer)   # chat's reasoning
        self._batch_window_s = config.stream_batch_interval_ms / 1e3
        engine_config = config.engine   # a property that builds an EngineConfig: read once
        self._routing_limits = {"capacity": engine_config.max_num_seqs,
                                "lora_budget": engine_config.max_loras_per_batch,
                                "host_slots": engine_config.max_loaded_loras}
        self.metrics = ServerMetrics(config.base_model_name, engine.max_model_len, engine_config.max_loras_per_batch)

    # ---- generation ---------------------------------------------------------------------------------
    async def generate(self, prompt: Prompt | None = None, sampling_params: SamplingParams | dict | None = None,
                       *, messages: list[dict] | None = None, request_id: str | None = None) -> ServedOutput:
        """The finished output (cumulative). The adapter is the call's `multiplexed_model_id`; `sampling_params`
        a SamplingParams, or its keyword arguments (deployments/choices.py `handle_call`)."""
        [out] = await self.generate_choices(prompt, sampling_params, messages=messages, request_id=request_id)
        return out

    async def generate_choices(self, prompt: Prompt | None = None,
                               sampling_params: SamplingParams | dict | None = None, *,
                               messages: list[dict] | None = None, request_id: str | None = None, n: int = 1,
                               best_of: int | None = None, echo: bool = False, names: bool = False,
                               tools: list[dict] | None = None,
                               chat_template_kwargs: dict | None = None) -> list[ServedOutput]:
        """`n` finished choices (`index` 0..n-1); with best_of, that many are sampled and the n with the highest
        cumulative logprob returned. `echo`: each carries the prompt's text (`prompt_text`); `names`: the text
        and bytes of every token it names (`token_names`, for logprobs); `tools`, `chat_template_kwargs`: rendered
        by the chat template (workers/tokenizer.render_chat)."""
        params = handle_call(sampling_params, messages is not None, n, best_of)
        return await self._choices(prompt, params, messages, request_id, n, best_of, echo, names, tools,
                                   chat_template_kwargs)

    async def _choices(self, prompt, params: SamplingParams, messages, request_id, n, best_of, echo, names, tools,
                       chat_template_kwargs) -> list[ServedOutput]:
        """`generate_choices` of choices checked already (a handle call's, or the ingress's request body)."""
        request = await self._start(prompt, params, messages, request_id, tools, chat_template_kwargs)
        count = best_of or n
        try:
            async with asyncio.TaskGroup() as group:   # one failing cancels the others (their requests abort)
                tasks = [group.create_task(self._collect(choice(request, i, count))) for i in range(count)]
        except BaseExceptionGroup as failed:   # the caller gets the error itself (its 4xx / 5xx class)
            raise failed.exceptions[0] from None
        outs = [task.result() for task in tasks]
        outs = best(outs, n) if ranks(n, best_of) else outs
        for index, out in enumerate(outs):
            self._describe(out, index, prompt if echo else None, names)
        return outs

    async def generate_stream(self, prompt: Prompt | None = None,
                              sampling_params: SamplingParams | dict | None = None, *,
                              messages: list[dict] | None = None, request_id: str | None = None, n: int = 1,
                              echo: bool = False, names: bool = False,
                              tools: list[dict] | None = None,
                              chat_template_kwargs: dict | None = None) -> AsyncIterator[ServedOutput]:
        """Deltas of `n` choices, interleaved (each item's `index` says whose): new tokens, text and logprobs
        (prompt_token_ids, and with echo prompt_text, on a choice's first item only).

        Text is held back while it may still change: a trailing partial UTF-8
        character, or a possible start of a stop string.
        """
        params = handle_call(sampling_params, messages is not None, n, stream=True)
        async with aclosing(self._stream(prompt, params, messages, request_id, n, echo, names, tools,
                                         chat_template_kwargs)) as items:
            async for item in items:
                yield item

    async def _stream(self, prompt, params: SamplingParams, messages, request_id, n, echo, names, tools,
                      chat_template_kwargs) -> AsyncIterator[ServedOutput]:
        """`generate_stream` of choices checked already (a handle call's, or the ingress's request body)."""
        request = await self._start(prompt, params, messages, request_id, tools, chat_template_kwargs)
        streams = [self._deltas(choice(request, i, n), i, prompt if echo else None, names) for i in range(n)]
        # one choice needs no merging (a task and a queue hop per token)
        async with aclosing(streams[0] if n == 1 else merge(streams)) as items:
            async for item in items:
                yield item

    # ---- OpenAI responses, rendered here ------------------------------------------------------------
    async def render_choices(self, prompt: Prompt | None, params: SamplingParams, spec: RenderSpec | ResponsesSpec,
                             *, messages: list[dict] | None = None, n: int = 1, best_of: int | None = None,
                             tools: list[dict] | None = None,
                             chat_template_kwargs: dict | None = None) -> RenderedChoices | RenderedResponse:
        """A whole answer's choices for one prompt, as JSON (render.join_body makes the body); a Responses
        request's whole body."""
        # n and best_of: checked with the request body (deployments/protocol.py)
        outs = await self._choices(prompt, params, messages, None, n, best_of, spec.echo, spec.logprobs,
                                   tools, chat_template_kwargs)
        return spec.render(outs, self.replica_id, self._think)

    async def render_stream(self, prompt: Prompt | None, params: SamplingParams, spec: RenderSpec | ResponsesSpec, *,
                            messages: list[dict] | None = None, n: int = 1,
                            tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> AsyncIterator[str | tuple[str, str]]:
        """A streamed answer's SSE events (usage chunk and [DONE] included), joined per step window. The
        first item is (replica id, events): it comes once the request is accepted, so a refused one raises
        before it; an error after it is raised after the events before it (the ingress reports it in-band)."""
        renderer = spec.stream_renderer(self._think)

        async def events() -> AsyncIterator[str]:
            # n: checked with the request body (deployments/protocol.py)
            async with aclosing(self._stream(prompt, params, messages, None, n, spec.echo, spec.logprobs,
                                             tools, chat_template_kwargs)) as items:
                async for item in items:
                    yield renderer.feed(item)
            yield renderer.finish()

        first = True
        async with aclosing(batched(events(), self._batch_window_s)) as batches:
            async for batch in batches:
                yield (self.replica_id, batch) if first else batch
                first = False

    async def _collect(self, request: EngineRequest) -> ServedOutput:
        token_ids, logprobs, text, top, prompt_logprobs, last = [], [], [], [], None, None
        async with aclosing(self._outputs(request)) as outputs:
            async for last in outputs:
                token_ids += last.token_ids
                logprobs += last.logprobs
                text.append(last.text)
                top += last.top_logprobs or []
                prompt_logprobs = last.prompt_logprobs if last.prompt_logprobs is not None else prompt_logprobs
        return self._served(last, request.prompt_token_ids, token_ids, "".join(text), logprobs,
                            top if request.params.top_logprobs else None, prompt_logprobs)

    async def _deltas(self, request: EngineRequest, index: int, echo_prompt: Prompt | None,
                      names: bool) -> AsyncIterator[ServedOutput]:
        first, prompt_ids = True, request.prompt_token_ids
        async with aclosing(self._outputs(request)) as outputs:
            async for out in outputs:
                if out.token_ids or out.text or out.finished:
                    item = self._served(out, prompt_ids if first else [], out.token_ids, out.text, out.logprobs,
                                        out.top_logprobs, out.prompt_logprobs, num_prompt_tokens=len(prompt_ids))
                    yield self._describe(item, index, echo_prompt if first else None, names)
                    first = False

    def _describe(self, out: ServedOutput, index: int, echo_prompt: Prompt | None, names: bool) -> ServedOutput:
        out.index = index
        if echo_prompt is not None:
            out.prompt_text = echo_prompt if isinstance(echo_prompt, str) else self.engine.decode_tokenizer.decode(
                echo_prompt)
        if names:
            ids = set(out.token_ids) | {t for alts in out.top_logprobs or [] for t, _ in alts}
            if echo_prompt is not None:
                ids |= set(out.prompt_token_ids)
                ids |= {t for entry in out.prompt_logprobs or [] if entry for t, _ in entry[1]}
            out.token_names = {t: self._token_names(t) for t in ids}
        return out

    async def _start(self, prompt: Prompt | None, params: SamplingParams, messages, request_id: str | None,
                     tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> EngineRequest:
        """The engine request, built and validated once (its choices share it): the adapter, the prompt's token
        ids (tokenized here, in front of the engine), the sampling parameters, the structured-output spec."""
        adapter = await self._adapter_for_request()   # an unknown adapter is a 404 before anything else
        if messages is not None:
            if prompt is not None:
                raise ValueError("give a prompt or chat messages, not both")
            prompt = await self.engine.render_chat(messages, tools=tools, chat_template_kwargs=chat_template_kwargs)
        request = await self.engine.make_request(prompt, params, adapter, request_id)
        if params.structured is not None:   # an invalid schema is a 400 here, before any choice is queued
            await self.engine.check_grammar(params.structured)
        return request

    async def _outputs(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        timer, last, outcome = RequestTimer(request.adapter, len(request.prompt_token_ids)), None, "error"
        try:
            async with aclosing(self.engine.generate_request(request, delta=True)) as stream:
                async for last in stream:
                    self.metrics.record_output(timer, last)   # TTFT / inter-token latency: as they arrive
                    yield last
            outcome = last.finish_reason
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "abort"
            raise
        finally:
            self.metrics.record_request(timer, outcome)

    def _served(self, out: RequestOutput, prompt_token_ids, token_ids, text, logprobs, top_logprobs=None,
                prompt_logprobs=None, num_prompt_tokens: int | None = None) -> ServedOutput:
        num_prompt = len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
        return ServedOutput(out.request_id, list(prompt_token_ids), list(token_ids), text, list(logprobs),
                            out.finish_reason, out.adapter, out.error, num_cached_tokens=out.num_cached_tokens,
                            top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                            num_prompt_tokens=num_prompt, replica_id=self.replica_id)

    # ---- tokens ---------------------------------------------------------------------------------------
    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                       add_special_tokens: bool | None = None, add_generation_prompt: bool = True,
                       return_token_strs: bool = False) -> dict[str, Any]:
        """vLLM's /tokenize: the prompt's (or the chat template's) token ids, as generation would see them."""
        if messages is not None:
            tokens = await self.engine.render_chat(messages, add_generation_prompt, bool(add_special_tokens))
        else:
            tokens = await self.engine.encoder.encode(prompt, add_special_tokens is not False)
        out = {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}
        out["token_strs"] = [self._token_names(t)[0] for t in tokens] if return_token_strs else None
        return out

    async def detokenize(self, tokens: list[int]) -> str:
        check_token_ids(tokens, self.engine.vocab_size, "tokens")
        return self.engine.decode_tokenizer.decode(tokens)

    async def __del__(self):
        """Serve's shutdown hook (also after a failed __init__: only what was built is torn down)."""
        await self._stop_adapters()
        if hasattr(self, "engine"):
            await asyncio.to_thread(self.engine.close)


def _start_engine(config: LLMConfig) -> AsyncLLMEngine:
    for name, source in config.adapters.items():   # before minutes of model loading: a plain, early reason
        if not is_hub_id(source) and not os.path.isdir(source):
            raise AdapterNotFoundError(f"configured adapter {name!r}: {source!r} is not a directory on this node")
    # the hot-load roots do not apply to configured adapters
    return start_engine(config.replica_engine_config(), config.adapters, config.engine_process)
