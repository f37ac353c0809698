"""The OpenAI-compatible HTTP ingress (FastAPI inside a Serve deployment).

One hop from a route to the engine: the route resolves `model` to an adapter
and calls LLMServer with `multiplexed_model_id=<adapter>`. Every error becomes
an OpenAI error body (errors.py). A stream's status is decided by its first
item, so a bad request is a 4xx even with `stream: true`; an error after that
arrives as an SSE error event. Response header `x-loraserve-replica` names the
LLMServer replica that served the request.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from deployments import protocol as oai
from deployments.adapter_registry import RegistryClient, RegistryView
from deployments.config import LLMConfig
from deployments.errors import ModelNotFoundError, error_response, sse_error
from deployments.loopback import bind_replica_grpc_to_node_ip
from deployments.metrics import render_prometheus
from workers.async_engine import EngineDeadError

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
HEALTH_TIMEOUT_S = 10.0
REPLICA_HEADER = "x-loraserve-replica"

app = FastAPI(title="loraserve", docs_url=None, redoc_url=None)


@app.exception_handler(RequestValidationError)
async def _invalid_body(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(exc)


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, server: DeploymentHandle, config: LLMConfig):
        bind_replica_grpc_to_node_ip()   # before Serve starts this replica's gRPC server (after __init__)
        self.server = server
        self.base_model = config.base_model_name
        app_name = serve.get_replica_context().app_name
        # /v1/models and /metrics answer from the registry, or from its last copy while it restarts
        self.registry = RegistryView(RegistryClient(app_name, self.base_model, config.registry_sync_interval_s))

    def _adapter_of(self, model: str) -> str | None:
        """`<base>` -> None; `<base>:<adapter>` or `<adapter>` -> the adapter (the server checks it exists)."""
        if model == self.base_model:
            return None
        name = model[len(self.base_model) + 1:] if model.startswith(self.base_model + ":") else model
        if not name or ":" in name:
            raise ModelNotFoundError(f"model {model!r} does not exist; serving {self.base_model!r} and its adapters")
        return name

    def _handle(self, adapter: str | None, stream: bool = False) -> DeploymentHandle:
        return self.server.options(multiplexed_model_id=adapter or "", stream=stream)

    async def _generate(self, adapter: str | None, prompt, params: dict[str, Any]):
        return await self._handle(adapter).generate.remote(prompt, params)

    # ---- generation ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, body: oai.CompletionRequest) -> Response:
        try:
            adapter = self._adapter_of(body.model)
            params = body.sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
            prompts = body.prompts()
            if body.stream:
                if len(prompts) > 1:
                    raise ValueError("stream=true takes a single prompt")
                return await self._stream(self._handle(adapter, stream=True).generate_stream.remote(
                    prompts[0], params), body, chat=False)
            outputs = await asyncio.gather(*(self._generate(adapter, p, params) for p in prompts))
        except Exception as exc:  # noqa: BLE001  (every failure becomes an OpenAI error body)
            return error_response(exc)
        choices = [oai.completion_choice(i, out.text, oai.finish_reason(out),
                                         oai.completion_logprobs(out) if body.wants_logprobs else None)
                   for i, out in enumerate(outputs)]
        usage = oai.usage(sum(o.num_prompt_tokens for o in outputs), sum(len(o.token_ids) for o in outputs))
        return JSONResponse(oai.completion_body(oai.new_id("cmpl"), body.model, choices, usage),
                            headers={REPLICA_HEADER: outputs[-1].replica_id})

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: oai.ChatCompletionRequest) -> Response:
        try:
            adapter = self._adapter_of(body.model)
            params = body.sampling_params(None)
            messages = body.chat_messages()
            if body.stream:
                return await self._stream(self._handle(adapter, stream=True).generate_stream.remote(
                    None, params, messages=messages), body, chat=True)
            out = await self._handle(adapter).generate.remote(None, params, messages=messages)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        logprobs = oai.chat_logprobs(out) if body.wants_logprobs else None
        choice = oai.chat_choice(0, out.text, oai.finish_reason(out), logprobs)
        usage = oai.usage(out.num_prompt_tokens, len(out.token_ids))
        return JSONResponse(oai.chat_body(oai.new_id("chatcmpl"), body.model, [choice], usage),
                            headers={REPLICA_HEADER: out.replica_id})

    async def _stream(self, items, body: oai.OpenAIRequest, chat: bool) -> Response:
        first = await items.__anext__()   # raises here (-> 4xx) for a request the server refused
        return StreamingResponse(self._sse(first, items, body, chat), media_type="text/event-stream",
                                 headers={REPLICA_HEADER: first.replica_id})

    async def _sse(self, first, items, body: oai.OpenAIRequest, chat: bool) -> AsyncIterator[str]:
        request_id = oai.new_id("chatcmpl" if chat else "cmpl")
        make_body = oai.chat_body if chat else oai.completion_body
        prompt_tokens, completion_tokens = first.num_prompt_tokens, 0

        def event(choices: list[dict], usage: dict | None = None) -> str:
            return f"data: {json.dumps(make_body(request_id, body.model, choices, usage, chunk=True))}\n\n"

        try:
            if chat:
                yield event([oai.chat_chunk_choice(0, {"role": "assistant", "content": ""}, None)])
            item = first
            while item is not None:
                completion_tokens += len(item.token_ids)
                finish = oai.finish_reason(item)
                if not (item.text or finish or body.wants_logprobs):
                    pass     # tokens whose text is still held back: nothing to show yet
                elif chat:
                    logprobs = oai.chat_logprobs(item) if body.wants_logprobs else None
                    delta = {"content": item.text} if item.text or not finish else {}
                    yield event([oai.chat_chunk_choice(0, delta, finish, logprobs)])
                else:
                    logprobs = oai.completion_logprobs(item) if body.wants_logprobs else None
                    yield event([oai.completion_choice(0, item.text, finish, logprobs)])
                item = await anext(items, None)
            if body.include_usage:
                yield event([], oai.usage(prompt_tokens, completion_tokens))
        except Exception as exc:  # noqa: BLE001  (the 200 is sent: report in-band)
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    # ---- models and adapters ------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self) -> JSONResponse:
        sources = await self.registry.adapters()
        data = [{"id": self.base_model, "object": "model", "owned_by": "loraserve", "parent": None}]
        data += [{"id": name, "object": "model", "owned_by": "loraserve", "parent": self.base_model,
                  "root": source} for name, source in sorted(sources.items())]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: oai.LoadLoRAAdapterRequest) -> Response:
        try:
            result = await self._handle(body.lora_name).load_adapter.remote(body.lora_name, body.lora_path)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse({"status": "loaded", **result})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: oai.UnloadLoRAAdapterRequest) -> Response:
        try:
            result = await self._handle(None).unload_adapter.remote(body.lora_name)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse({"status": "unloaded", **result})

    # ---- operations ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """200 when a replica answers healthy (Serve routes around the others); else 503."""
        try:
            healthy = await asyncio.wait_for(self._handle(None).is_healthy.remote(), HEALTH_TIMEOUT_S)
            if not healthy:
                raise EngineDeadError("the engine is not healthy")
        except Exception as exc:  # noqa: BLE001
            return error_response(exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc)))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        per_replica: dict[str, Any] = await self.registry.replica_stats()
        return PlainTextResponse(render_prometheus(per_replica, self.base_model),
                                 media_type="text/plain; version=0.0.4")
