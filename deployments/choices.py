"""Several choices for one prompt (OpenAI's n and best_of), as sequences of their own in one replica.

They share the prompt's KV: admitted in the same step, every choice after the first finds the
prompt's full blocks already offered to the prefix cache (workers/controller.py). Choice i of a
seeded request uses seed + i (as vLLM does), so each has its own reproducible stream.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import AsyncIterator

from workers.config import SamplingParams
from workers.request import EngineRequest

MAX_CHOICES = 16   # n, best_of: each choice is a sequence of its own


def check_choices(n: int, best_of: int | None = None, stream: bool = False) -> None:
    """The rules of n and best_of, for request bodies and handle calls alike."""
    for name, value in (("n", n), ("best_of", best_of)):
        if value is not None and (type(value) is not int or not 1 <= value <= MAX_CHOICES):
            raise ValueError(f"{name} must be an integer in [1, {MAX_CHOICES}], got {value!r}")
    if best_of is not None and best_of < n:
        raise ValueError(f"best_of ({best_of}) must be >= n ({n})")
    if stream and best_of is not None and best_of > n:
        raise ValueError("best_of > n cannot be streamed (the best ones are known only at the end)")


def ranks(n: int, best_of: int | None) -> bool:
    """Whether the choices are ranked by their cumulative logprob (`best`), so the engine must compute them."""
    return best_of is not None and best_of > n


def handle_call(sampling_params: SamplingParams | dict | None, chat: bool, n: int, best_of: int | None = None,
                stream: bool = False) -> SamplingParams:
    """A handle call's choices checked and its sampling parameters in the one form they keep to the engine: a
    SamplingParams as given, or (the handle API's other form, docs/serving.md) its keyword arguments, None meaning
    the default, built once. A chat's max_tokens defaults to the rest of the context, as on the chat route."""
    check_choices(n, best_of, stream)
    if isinstance(sampling_params, SamplingParams):
        params = sampling_params
    else:
        kwargs = {name: value for name, value in (sampling_params or {}).items() if value is not None}
        params = SamplingParams(**({"max_tokens": None} if chat else {}) | kwargs)
    if ranks(n, best_of) and not params.logprobs:
        raise ValueError(f"best_of ({best_of}) > n ranks the choices by their logprobs: logprobs cannot be False")
    return params


def choice(request: EngineRequest, index: int, count: int) -> EngineRequest:
    """Choice `index` of `count`: the request as validated, its own id and seed (nothing is checked again)."""
    if count == 1:
        return request
    params = request.params
    if index and params.seed is not None:   # unseeded: the engine draws each request's own seed
        params = copy.copy(params)
        params.seed += index
    request_id = None if request.request_id is None else f"{request.request_id}-{index}"
    return dataclasses.replace(request, request_id=request_id, params=params)


def best(outputs: list, n: int) -> list:
    """The n choices with the highest cumulative logprob (OpenAI's best_of), in their sampling order on ties."""
    ranked = sorted(range(len(outputs)), key=lambda i: (-sum(outputs[i].logprobs), i))
    return [outputs[i] for i in ranked[:n]]


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of every stream as they come. Leaving early (or one stream failing) closes all of them, so each
    choice's request is aborted in the engine."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the reader)
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:   # a cancelled pump's stream gets the cancellation inside it: its request is aborted
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
