"""What every HTTP request passes before a route's own work: the API key, the body's size, encoding and JSON.

Routes read their body through `read_body` instead of FastAPI's body parameters,
so the key is checked before a byte of the body is read, the size is bounded
while reading (Content-Length or chunked), and every refusal (401, 413, 415,
bad UTF-8, malformed JSON) is an OpenAI error body. Routing errors (404, 405)
and anything a route lets escape get the same shape from `install_error_handlers`.
"""
from __future__ import annotations

import hmac
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from deployments.errors import APIError, error_response

REQUEST_ID_HEADER = "x-request-id"   # set by Serve's proxy on every request and response
Body = TypeVar("Body", bound=BaseModel)


def request_id(request: Request) -> str | None:
    value = request.headers.get(REQUEST_ID_HEADER)
    return value[:64] if value else None    # a client may send its own: bounded in our log lines


def check_api_key(request: Request, api_key: bytes | None) -> None:
    """`Authorization: Bearer <key>`, compared in constant time (no timing oracle on the key)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
        raise APIError(401, "AuthenticationError", "invalid_api_key",
                       "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})


async def read_body(request: Request, model: type[Body], max_bytes: int) -> Body:
    """The request's JSON body as `model` (strict), refused before parsing if it is too large or not UTF-8."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    # Required, not guessed: a browser page can POST text/plain to a local server without a CORS
    # preflight, but not application/json.
    if media_type != "application/json":
        raise APIError(415, "BadRequestError", "unsupported_media_type",
                       "send the request body as JSON with the header 'Content-Type: application/json'")
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise APIError(400, "BadRequestError", "invalid_request", "the Content-Length header is not a number")
    if declared is not None and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():   # chunked uploads carry no Content-Length: count as they arrive
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    try:
        text = b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, "BadRequestError", "invalid_utf8",
                       f"the request body is not valid UTF-8 (at byte {error.start})") from None
    return model.model_validate_json(text)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, "BadRequestError", "request_too_large",
                    f"the request body is larger than this server's limit of {max_bytes} bytes (max_request_bytes)")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI bodies for what FastAPI / Starlette answer themselves: unknown routes, wrong methods, bugs."""
    # (registered on the module's app before Serve freezes a copy of it in @serve.ingress)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        route = f"{request.method} {request.url.path[:200]}"
        if exc.status_code == 404:
            error = APIError(404, "NotFoundError", "not_found", f"no route {route}")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            error = APIError(405, "BadRequestError", "method_not_allowed",
                             f"method {request.method} is not allowed on {request.url.path[:200]}"
                             + (f" (allowed: {allowed})" if allowed else ""), headers=exc.headers)
        else:
            error = APIError(exc.status_code, "BadRequestError" if exc.status_code < 500 else "InternalServerError",
                             "invalid_request" if exc.status_code < 500 else "internal_error",
                             str(exc.detail) if exc.status_code < 500 else "internal server error", exc.headers)
        return error_response(error, request_id(request), route)

    @app.exception_handler(RequestValidationError)   # a route with FastAPI-parsed parameters
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(exc, request_id(request), f"{request.method} {request.url.path[:200]}")

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this, and Serve logs it with its traceback: not logged twice here.
        return error_response(exc, request_id(request), f"{request.method} {request.url.path[:200]}", log=False)
