"""Exceptions -> OpenAI error bodies `{"error": {"message", "type", "code"}}`, HTTP statuses and log lines.

A caller's mistake is a 4xx whose message names the mistake, and one WARNING
line in the log. Our own failures are 5xx whose message says only what kind
of failure it was and the request id; their detail (actor ids, pids,
addresses, tracebacks) goes to the log under that id. Exceptions raised in
another replica arrive wrapped in RayTaskError (which also subclasses the
original); status and message are taken from the original.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from deployments.adapter_registry import RegistryUnavailableError
from lora.errors import AdapterNotFoundError
from workers.errors import EngineDeadError, RequestError

logger = logging.getLogger("ray.serve")
MAX_MESSAGE_CHARS = 1000
# union members in a pydantic error location ('str', 'list[int]', 'ChatMessage'): not the caller's field names
_UNION_TAG = re.compile(r"[A-Z]\w*|(str|int|float|bool|none|list|dict|literal|function-\w+|tagged-union)(\[.*\])?")
_VALIDATION_400 = {"json_invalid": "invalid_json", "extra_forbidden": "unknown_parameter",
                   "unsupported_parameter": "unsupported_parameter", "value_too_long": "invalid_request"}
# 503s: what the caller may be told (retry later); the exception's own text stays in the log
_UNAVAILABLE = ((EngineDeadError, "the model engine is unavailable (a worker failed; it is being replaced)"),
                (BackPressureError, "the server is at capacity"),
                ((DeploymentUnavailableError, ReplicaUnavailableError), "no model replica is available"),
                (RayActorError, "a service component is restarting"),
                (RegistryUnavailableError, "the adapter registry is restarting; try again in a few seconds"),
                (TimeoutError, "the operation timed out"))


class ModelNotFoundError(LookupError):
    """The request names a model that is neither the base model nor a known adapter."""


class APIError(Exception):
    """An error decided at the HTTP edge, with its status: 401, 403, 404 / 405 routing, 413, 415, bad UTF-8."""

    def __init__(self, status: int, kind: str, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.headers = status, kind, code, headers or {}


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(HTTP status, OpenAI error type, code) of an exception."""
    exc = _unwrap(exc)
    if isinstance(exc, APIError):
        return exc.status, exc.kind, exc.code
    if isinstance(exc, (AdapterNotFoundError, ModelNotFoundError)):
        return 404, "NotFoundError", "model_not_found"
    if isinstance(exc, (RequestValidationError, ValidationError)):
        codes = [_VALIDATION_400[e["type"]] for e in exc.errors() if e.get("type") in _VALIDATION_400]
        return 400, "BadRequestError", codes[0] if codes else "invalid_request"   # OpenAI's status, not FastAPI's 422
    if isinstance(exc, ClientDisconnect):
        return 400, "BadRequestError", "client_disconnected"
    if isinstance(exc, (ValueError, TypeError)):   # bad parameters, AdapterError (rank, path, format)
        return 400, "BadRequestError", "invalid_request"
    if any(isinstance(exc, kinds) for kinds, _ in _UNAVAILABLE):
        return 503, "ServiceUnavailableError", "service_unavailable"
    if isinstance(exc, RequestError):
        return 500, "InternalServerError", "request_failed"
    return 500, "InternalServerError", "internal_error"


def message_of(exc: BaseException, request_id: str | None = None) -> str:
    status, _, _ = classify(exc)
    exc = _unwrap(exc)
    if status >= 500:
        reason = next((text for kinds, text in _UNAVAILABLE if isinstance(exc, kinds)),
                      "the engine failed this request" if isinstance(exc, RequestError) else "internal server error")
        retry = "; retry later" if status == 503 else ""
        return f"{reason}{retry}" + (f" (request id {request_id})" if request_id else "")
    if isinstance(exc, (RequestValidationError, ValidationError)):
        text = describe_validation_errors(exc.errors())
    else:
        text = (str(exc.args[0]) if len(exc.args) == 1 else str(exc)) or type(exc).__name__
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


def describe_validation_errors(errors: list[dict]) -> str:
    """`field: what is wrong` per field the caller got wrong; a union's alternatives become one line."""
    by_field: dict[str, list[tuple[list, dict]]] = {}
    for error in errors:
        loc = [p for p in error.get("loc", ()) if not (isinstance(p, str) and _UNION_TAG.fullmatch(p))]
        if loc[:1] == ["body"]:
            loc = loc[1:]
        by_field.setdefault(str(loc[0]) if loc else "", []).append((loc, error))
    parts = []
    for field, items in by_field.items():
        if len({tuple(loc) for loc, _ in items}) < len(items) or len(items) > 3:   # a union: every member failed
            parts.append(f"{field}: invalid value (wrong type or shape)")
            continue
        for loc, error in items:
            where = ".".join(str(p) for p in loc)
            parts.append(f"{where}: {_error_text(error)}" if where else _error_text(error))
    return "; ".join(parts)


def _error_text(error: dict) -> str:
    kind = error.get("type")
    if kind == "extra_forbidden":
        return "unknown field (not part of this API)"
    if kind == "missing":
        return "field required"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return "expected a JSON object"
    if kind == "json_invalid":
        return f"malformed JSON: {error.get('ctx', {}).get('error', error.get('msg'))}"
    return str(error.get("msg"))


def error_body(exc: BaseException, request_id: str | None = None) -> tuple[int, dict]:
    status, kind, code = classify(exc)
    return status, {"error": {"message": message_of(exc, request_id), "type": kind, "code": code,
                              "param": param_of(exc)}}


def param_of(exc: BaseException) -> str | None:
    """OpenAI's `param`: the (first) request field a validation error is about."""
    exc = _unwrap(exc)
    if not isinstance(exc, (RequestValidationError, ValidationError)):
        return None
    for error in exc.errors():
        loc = [p for p in error.get("loc", ()) if not (isinstance(p, str) and _UNION_TAG.fullmatch(p))]
        loc = loc[1:] if loc[:1] == ["body"] else loc
        field = ".".join(str(p) for p in loc) or (error.get("ctx") or {}).get("field")
        if field:
            return str(field)[:200]
    return None


def error_response(exc: BaseException, request_id: str | None = None, route: str = "",
                   log: bool = True) -> JSONResponse:
    status, body = error_body(exc, request_id)
    if log:
        log_error(exc, status, body, request_id, route)
    headers = dict(getattr(_unwrap(exc), "headers", None) or {})
    return JSONResponse(body, status_code=status, headers=headers)


def sse_error(exc: BaseException, request_id: str | None = None, route: str = "") -> str:
    """An error after a stream started (its 200 is sent): an SSE event the openai client raises on."""
    status, body = error_body(exc, request_id)
    log_error(exc, status, body, request_id, route)
    return f"data: {json.dumps(body)}\n\n"


def log_error(exc: BaseException, status: int, body: dict, request_id: str | None, route: str) -> None:
    """A caller's mistake: one WARNING line (and what caused it, if not ours to show); ours: ERROR + traceback."""
    head = f"request {request_id} {route} -> {status} {body['error']['code']}"
    if status >= 500:
        logger.error("%s: %r", head, _unwrap(exc), exc_info=exc)
        return
    cause = _unwrap(exc).__cause__
    logger.warning("%s: %s%s", head, body["error"]["message"][:300], f" (cause: {cause!r:.300})" if cause else "")


class CallerErrorLogFilter(logging.Filter):
    """Serve logs every exception a replica method raises as ERROR with a traceback ("Request failed.",
    ray/serve/_private/replica.py, `_handle_errors_and_metrics`).

    A caller's mistake (a 4xx) is not a failure of this replica: that record becomes one INFO line
    without traceback (the ingress logs the request's WARNING line), so bad requests cannot flood the
    log. Only records of Serve's replica module are touched: if Serve moves that code, tracebacks come
    back (tests/test_security.py notices) rather than anything else being hidden.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _from_serve_replica(record) and classify(exc)[0] < 500:
            record.msg, record.args = f"{record.getMessage()} (caller error: {message_of(exc)[:300]})", ()
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def _from_serve_replica(record: logging.LogRecord) -> bool:
    path = Path(record.pathname)
    return path.name == "replica.py" and path.parent.name == "_private" and path.parent.parent.name == "serve"


def quiet_caller_errors() -> None:
    """Install CallerErrorLogFilter on Serve's logger of this process (once)."""
    if not any(isinstance(f, CallerErrorLogFilter) for f in logger.filters):
        logger.addFilter(CallerErrorLogFilter())
