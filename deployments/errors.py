"""Exceptions -> OpenAI error bodies `{"error": {"message", "type", "code"}}` and HTTP statuses.

A caller's mistake is a 4xx with the reason; only our own failures are 5xx.
Exceptions raised in another replica arrive wrapped in RayTaskError (which
also subclasses the original); the message is taken from the original.
"""
from __future__ import annotations

import json

from fastapi.exceptions import RequestValidationError
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.responses import JSONResponse

from deployments.adapter_registry import RegistryUnavailableError
from lora.errors import AdapterNotFoundError
from workers.async_engine import EngineDeadError, RequestError


class ModelNotFoundError(LookupError):
    """The request names a model that is neither the base model nor a known adapter."""


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, code) of an exception."""
    exc = _unwrap(exc)
    if isinstance(exc, (AdapterNotFoundError, ModelNotFoundError)):
        return 404, "NotFoundError", "model_not_found"
    if isinstance(exc, RequestValidationError):
        malformed = any(e.get("type") == "json_invalid" for e in exc.errors())
        return (400, "BadRequestError", "invalid_json") if malformed else (422, "BadRequestError", "invalid_request")
    if isinstance(exc, (ValueError, TypeError)):   # bad parameters, AdapterError (rank, path, format)
        return 400, "BadRequestError", "invalid_request"
    if isinstance(exc, (EngineDeadError, BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError,
                        RegistryUnavailableError)):
        return 503, "ServiceUnavailableError", "service_unavailable"
    if isinstance(exc, RequestError):
        return 500, "InternalServerError", "request_failed"
    return 500, "InternalServerError", "internal_error"


def message_of(exc: BaseException) -> str:
    exc = _unwrap(exc)
    if isinstance(exc, RequestValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
    text = str(exc.args[0]) if len(exc.args) == 1 else str(exc)
    return text or type(exc).__name__


def error_body(exc: BaseException) -> tuple[int, dict]:
    status, kind, code = classify(exc)
    return status, {"error": {"message": message_of(exc), "type": kind, "code": code, "param": None}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status)


def sse_error(exc: BaseException) -> str:
    """An error after a stream started (its 200 is sent): an SSE event the openai client raises on."""
    _, body = error_body(exc)
    return f"data: {json.dumps(body)}\n\n"
