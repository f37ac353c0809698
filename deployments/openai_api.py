"""The OpenAI-compatible HTTP ingress (FastAPI inside a Serve deployment).

One hop from a route to the engine: the route parses and validates the body,
resolves `model` to an adapter and calls LLMServer with
`multiplexed_model_id=<adapter>` (through a cached handle); the replica renders
the response (deployments/render.py: the body's choices, or the SSE events in
batches per step window) and the route relays it. Every error becomes an OpenAI
error body (errors.py). A stream's status is decided by its first item, so a
bad request is a 4xx even with `stream: true`; an error after that arrives as
an SSE error event. Response header `x-loraserve-replica` names the
LLMServer replica that served the request; `x-request-id` (Serve's) names the
request in the logs. Every /v1 route checks the API key first (/metrics only with
`metrics_require_api_key`), then reads its body through http_edge (size, UTF-8, strict schema).
"""
# No `from __future__ import annotations`: Serve pickles these route functions by value with only the
# globals their code uses, so FastAPI could not resolve a string annotation such as "Request".
import asyncio
import dataclasses
import importlib.metadata
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from deployments import protocol as oai
from deployments import utility_requests as utility
from deployments import responses as rs
from deployments.adapter_registry import RegistryClient, RegistryView
from deployments.config import LLMConfig
from deployments.errors import APIError, ModelNotFoundError, error_response, quiet_caller_errors, sse_error
from deployments.http_edge import Body, check_api_key, install_error_handlers, read_body, request_id
from deployments.loopback import bind_replica_grpc_to_node_ip
from deployments.metrics import render_prometheus
from deployments.render import DONE, RenderSpec, join_body
from deployments.responses_api import ResponsesRequest
from deployments.vllm_metrics import render_vllm
from lora.names import ADAPTER_NAME, check_adapter_name
from workers.config import SamplingParams
from workers.errors import EngineDeadError
from workers.heap import freeze_startup_heap

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
HEALTH_TIMEOUT_S = 10.0
REPLICA_HEADER = "x-loraserve-replica"
MAX_CACHED_HANDLES = 1024
logger = logging.getLogger("ray.serve")

app = FastAPI(title="loraserve", docs_url=None, redoc_url=None, openapi_url=None)
install_error_handlers(app)


@serve.ingress(app)
class OpenAIIngress:
    async def __init__(self, server: DeploymentHandle, config: LLMConfig):
        bind_replica_grpc_to_node_ip()   # before Serve starts this replica's gRPC server (after __init__)
        quiet_caller_errors()
        self.server = server
        self._handles: dict[tuple[str, bool], DeploymentHandle] = {}
        self.base_model = config.base_model_name
        self.api_key = config.api_key.get_secret_value().encode() if config.api_key else None
        self.metrics_api_key = self.api_key if config.metrics_require_api_key else None
        self.enable_hotload, self.max_request_bytes = config.enable_hotload, config.max_request_bytes
        for warning in config.startup_warnings():
            logger.warning("loraserve: %s", warning)
        app_name = serve.get_replica_context().app_name
        # /v1/models and /metrics answer from the registry, or from its last copy while it restarts
        self.registry = RegistryView(RegistryClient(app_name, self.base_model, config.registry_sync_interval_s))
        # Ready (so Serve routes HTTP here) only once an LLMServer replica answers: it has put the configured
        # adapters in the registry and can serve them, so /v1/models lists them from its first answer.
        await self._handle(None).is_healthy.remote()
        freeze_startup_heap()   # as the replica's: no collection's pause over the start-up objects while streaming

    def _adapter_of(self, model: str) -> str | None:
        """`<base>` -> None; `<base>:<adapter>` or `<adapter>` -> the adapter (the server checks it exists)."""
        if model == self.base_model:
            return None
        name = model[len(self.base_model) + 1:] if model.startswith(self.base_model + ":") else model
        if not ADAPTER_NAME.fullmatch(name):   # no such adapter can exist: no call to a replica for it
            raise ModelNotFoundError(f"model {model[:200]!r} does not exist; serving {self.base_model!r} and its "
                                     "adapters (GET /v1/models)")
        return name

    def _handle(self, adapter: str | None, stream: bool = False) -> DeploymentHandle:
        """The server's handle configured for (adapter, stream), built once: each `.options()` is a new
        handle object (Ray Serve LLM's ingress caches them the same way). Bounded: names come from callers."""
        key = (adapter or "", stream)
        handle = self._handles.pop(key, None) or self.server.options(multiplexed_model_id=key[0], stream=stream)
        self._handles[key] = handle   # most recently used last
        if len(self._handles) > MAX_CACHED_HANDLES:
            del self._handles[next(iter(self._handles))]
        return handle

    async def _read(self, request: Request, model: type[Body]) -> Body:
        check_api_key(request, self.api_key)
        return await read_body(request, model, self.max_request_bytes)

    def _check_hotload(self, request: Request) -> None:
        check_api_key(request, self.api_key)
        # 403 with the switch, not vLLM's 404 of an unregistered route: a documented route answering
        # "no such route" reads as a wrong URL, and the switch's existence is public (this code).
        if not self.enable_hotload:
            raise APIError(403, "PermissionDeniedError", "hotload_disabled",
                           "runtime adapter loading is disabled on this server; start it with --enable-hotload "
                           "(enable_hotload: true in the LLMConfig / serve_config.yaml)")

    @staticmethod
    def _error(exc: BaseException, request: Request) -> Response:
        return error_response(exc, request_id(request), f"{request.method} {request.url.path[:200]}")

    # ---- generation ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        try:
            body = await self._read(request, oai.CompletionRequest)
            adapter = self._adapter_of(body.model)
            params = body.to_sampling_params(COMPLETION_DEFAULT_MAX_TOKENS)
            prompts = body.prompts()
            spec = RenderSpec.of(body, chat=False)
            if len(prompts) * (body.best_of or body.n) > oai.MAX_PROMPTS:
                raise ValueError(f"{len(prompts)} prompts x {body.best_of or body.n} choices is more than "
                                 f"{oai.MAX_PROMPTS} sequences in one request")
            if body.stream:
                if len(prompts) > 1:
                    raise ValueError("stream=true takes a single prompt")
                return await self._relay(self._handle(adapter, stream=True).render_stream.remote(
                    prompts[0], params, spec, n=body.n), request)
            handle = self._handle(adapter)   # OpenAI numbers the choices prompt after prompt
            parts = await asyncio.gather(*(handle.render_choices.remote(
                p, params, dataclasses.replace(spec, first_index=i * body.n), n=body.n, best_of=body.best_of)
                for i, p in enumerate(prompts)))
        except Exception as exc:  # noqa: BLE001  (every failure becomes an OpenAI error body)
            return self._error(exc, request)
        return self._body(spec, parts)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await self._read(request, oai.ChatCompletionRequest)
            adapter = self._adapter_of(body.model)
            params = body.to_sampling_params()
            spec = RenderSpec.of(body, chat=True)
            options = dict(messages=body.chat_messages(), n=body.n, tools=body.template_tools(),
                           chat_template_kwargs=body.template_kwargs())
            if body.stream:
                return await self._chat_stream(adapter, params, spec, options, request)
            part = await self._handle(adapter).render_choices.remote(None, params, spec, **options)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, request)
        return self._body(spec, [part])

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, served as the chat completion it means (deployments/responses_api.py); the
        replica renders the Responses output and events (deployments/responses_render.py)."""
        try:
            body = await self._read(request, ResponsesRequest)
            chat = body.chat_request()
            adapter = self._adapter_of(body.model)
            params, spec = chat.to_sampling_params(), body.render_spec(chat)
            options = dict(messages=chat.chat_messages(), tools=chat.template_tools(),
                           chat_template_kwargs=chat.template_kwargs())
            if body.stream:
                return await self._chat_stream(adapter, params, spec, options, request)
            rendered = await self._handle(adapter).render_choices.remote(None, params, spec, **options)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, request)
        return Response(rendered.body, media_type="application/json", headers={REPLICA_HEADER: rendered.replica_id})

    @staticmethod
    def _body(spec: RenderSpec, parts: list) -> Response:
        return Response(join_body(spec, parts), media_type="application/json",
                        headers={REPLICA_HEADER: parts[-1].replica_id})

    async def _chat_stream(self, adapter: str | None, params: SamplingParams, spec, options: dict,
                           request: Request) -> Response:
        """A chat-shaped request's stream (chat completions, Responses): the replica renders `spec`'s events."""
        return await self._relay(self._handle(adapter, stream=True).render_stream.remote(
            None, params, spec, **options), request)

    async def _relay(self, batches, request: Request) -> Response:
        """The replica's rendered SSE events, as they come."""
        replica_id, first = await batches.__anext__()   # raises here (-> 4xx) for a request the server refused
        return StreamingResponse(self._events(first, batches, request), media_type="text/event-stream",
                                 headers={REPLICA_HEADER: replica_id})

    @staticmethod
    async def _events(first: str, batches, request: Request) -> AsyncIterator[str]:
        try:
            if first:
                yield first
            async for batch in batches:
                yield batch
        except Exception as exc:  # noqa: BLE001  (the 200 is sent: report in-band, as the replica would not)
            yield sse_error(exc, request_id(request), f"{request.method} {request.url.path[:200]}")
            yield DONE

    # ---- tokens -------------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        """vLLM's: {count, max_model_len, tokens, token_strs} of a prompt or of chat messages."""
        try:
            body = await self._read(request, utility.TokenizeRequest)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages] if body.messages else None
            result = await self._handle(self._adapter_of(body.model)).tokenize.remote(
                body.prompt, messages, body.add_special_tokens, body.add_generation_prompt, body.return_token_strs)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, request)
        return JSONResponse(result)

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._read(request, utility.DetokenizeRequest)
            prompt = await self._handle(self._adapter_of(body.model)).detokenize.remote(body.tokens)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, request)
        return JSONResponse({"prompt": prompt})

    # ---- models and adapters ------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            check_api_key(request, self.api_key)
        except APIError as exc:
            return self._error(exc, request)
        sources = await self.registry.adapters()
        data = [rs.model_card(self.base_model, None)] + [rs.model_card(name, self.base_model)
                                                         for name in sorted(sources)]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        try:
            check_api_key(request, self.api_key)
            name = self._adapter_of(model_id)
            if name is not None and name not in await self.registry.adapters():
                raise ModelNotFoundError(f"model {model_id[:200]!r} does not exist (GET /v1/models)")
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, request)
        return JSONResponse(rs.model_card(model_id, None if name is None else self.base_model))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        try:
            self._check_hotload(request)
            body = await read_body(request, utility.LoadLoRAAdapterRequest, self.max_request_bytes)
            name = check_adapter_name(body.lora_name, self.base_model)
            result = await self._handle(name).load_adapter.remote(name, body.lora_path, replace=body.replace)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, request)
        return JSONResponse({"status": "loaded", **result})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        try:
            self._check_hotload(request)
            body = await read_body(request, utility.UnloadLoRAAdapterRequest, self.max_request_bytes)
            result = await self._handle(None).unload_adapter.remote(body.lora_name)
        except Exception as exc:  # noqa: BLE001
            return self._error(exc, request)
        return JSONResponse({"status": "unloaded", **result})

    # ---- operations ---------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self, request: Request) -> Response:
        """200 when a replica answers healthy (Serve routes around the others); else 503."""
        try:
            healthy = await asyncio.wait_for(self._handle(None).is_healthy.remote(), HEALTH_TIMEOUT_S)
            if not healthy:
                raise EngineDeadError("the engine is not healthy")
        except Exception as exc:  # noqa: BLE001  (the cause goes to the log; the caller is told "unavailable")
            error = exc if isinstance(exc, EngineDeadError) else EngineDeadError("health check failed")
            if error is not exc:
                error.__cause__ = exc
            return self._error(error, request)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version(self, request: Request) -> Response:
        """vLLM's: the server's version (no key: it says nothing about the models or adapters)."""
        return JSONResponse({"version": importlib.metadata.version("loraserve")})

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """vLLM's metrics for the whole application (deployments/vllm_metrics.py), then ours per replica. Open
        unless `metrics_require_api_key`: Prometheus scrapes vLLM's /metrics without a key."""
        try:
            check_api_key(request, self.metrics_api_key)
        except APIError as exc:
            return self._error(exc, request)
        per_replica: dict[str, Any] = await self.registry.replica_stats()
        text = render_vllm(per_replica, self.base_model) + render_prometheus(per_replica, self.base_model)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")
