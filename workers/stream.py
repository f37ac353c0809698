"""The channel of one request's outputs from the engine's step thread to its reader's event loop."""
from __future__ import annotations

import asyncio
from typing import Callable

from workers.sequence import TokenDelta


class RequestStream:
    """Deltas of one request not read yet, handed from the step thread to the caller's event loop."""

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
