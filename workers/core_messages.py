"""What a replica asks its engine process (workers/engine_process.py, parent -> child): one typed
message per request of the callers' side, answered by the child's handler for its type (`handlers`, never
a method looked up by name). Sent as ("call", id, message), answered by ("reply", id, ok, value); or as
("post", message), answered by nothing (`ReleaseRequest`, `Close`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from workers.grammar import StructuredSpec
from workers.request import EngineRequest

if TYPE_CHECKING:
    from workers.core_client import ThreadCoreClient


@dataclass(frozen=True)
class AddRequest:
    """Queue a validated request (its grammar compiled first: an invalid one is refused, unqueued)."""
    request: EngineRequest


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request now; answered once the engine dropped it."""
    request_id: str


@dataclass(frozen=True)
class ReleaseRequest:
    """Stop a request whose reader has what it wants (posted: nobody waits)."""
    request_id: str


@dataclass(frozen=True)
class CompileGrammar:
    spec: StructuredSpec


@dataclass(frozen=True)
class LoadAdapter:
    name: str
    source: str
    pinned: bool = False


@dataclass(frozen=True)
class UnloadAdapter:
    name: str


@dataclass(frozen=True)
class ListAdapters:
    pass


@dataclass(frozen=True)
class PrefetchAdapters:
    names: tuple[str, ...]
    replace: tuple[str, ...] = ()


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class CheckHealth:
    pass


@dataclass(frozen=True)
class Close:
    """The child stops its step loop and exits (posted)."""


def handlers(core: ThreadCoreClient) -> dict[type, Callable[[Any], Awaitable]]:
    """Each call's message type -> what the child's core client does for it (awaited on the child's loop)."""
    return {AddRequest: lambda m: core.add(m.request),
            AbortRequest: lambda m: core.abort(m.request_id),
            CompileGrammar: lambda m: core.compile_grammar(m.spec),
            LoadAdapter: lambda m: core.load_adapter(m.name, m.source, m.pinned),
            UnloadAdapter: lambda m: core.unload_adapter(m.name),
            ListAdapters: lambda m: core.list_adapters(),
            PrefetchAdapters: lambda m: core.prefetch_adapters(list(m.names), list(m.replace)),
            GetStats: lambda m: core.stats(),
            CheckHealth: lambda m: core.check_health()}
