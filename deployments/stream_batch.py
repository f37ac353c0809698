"""Coalescing a stream of strings into fewer, larger items (a streamed response crossing Ray).

Every item a replica yields to a streaming handle is one Ray object and one report to the caller,
whatever its size; the ingress then hands each to its ASGI stream. So the replica sends what is
ready together: the first item alone and at once (time to first token), then, once something new
is ready, whatever else arrives within `window_s` joined to it (the other choices' tokens of the
same engine step, a stop's final chunk, or, with a window longer than a step, several steps).
Ray Serve LLM's LLMServer batches its stream for the same reason (`_batch_output_stream`), on a
fixed timer; here a quiet stream costs no wake-ups, and a window of 0 still joins what the event
loop has ready at once.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator


async def batched(source: AsyncIterator[str], window_s: float) -> AsyncIterator[str]:
    """The strings of `source`, joined per window. The first item is yielded even when empty (it tells
    the caller the request was accepted); later empty joins are skipped. An error of `source` is
    raised after what came before it; leaving early closes `source` (its request is aborted)."""
    pending: list[str] = []
    ready = asyncio.Event()
    ended: list[BaseException | None] = []   # one entry once the source is exhausted (its error, or None)

    async def read() -> None:
        try:
            async for item in source:
                pending.append(item)
                ready.set()
            ended.append(None)
        except Exception as exc:  # noqa: BLE001  (re-raised by the consumer, after what came before it)
            ended.append(exc)
        ready.set()

    reader = asyncio.ensure_future(read())
    first = True
    try:
        while True:
            await ready.wait()
            if not first and not ended:   # gather the rest of this window
                await asyncio.sleep(window_s)
            ready.clear()
            # Whether the source had ended, read before taking `pending` (it appends its items before it
            # ends): items it adds while this generator is suspended at the yield are sent next round.
            finished = list(ended)
            joined, count = "".join(pending), len(pending)
            pending.clear()
            if count and (joined or first):
                yield joined
                first = False
            if finished:
                if finished[0] is not None:
                    raise finished[0]
                return
    finally:   # the reader's cancellation reaches inside `source`: its generators close
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
