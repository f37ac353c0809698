"""The engine's errors that callers outside the engine's process catch (the ingress, the HTTP error mapping):
here, apart from the engine, so that catching them imports no torch."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The step loop is gone (it crashed or the engine was closed)."""


class RequestError(RuntimeError):
    """The engine ended this request with an error (its message says why)."""
