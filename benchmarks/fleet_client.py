"""The fleet benchmark's client: open-loop streamed /v1/completions, every request sent at its arrival time.

Each request's record: the replica that served it (the `x-loraserve-replica` header), when it was sent, its
first and last token and its end (seconds from the run's start), its tokens, and how it ended:
- "ok": the whole stream, [DONE] included, with every token asked for (ignore_eos);
- "error": the server said it failed (an HTTP error status or an in-band error event);
- "lost": neither: the connection dropped without an error, the stream ended short, or no answer by the
  run's deadline. A fleet must lose none, even when a replica dies under it.
"""
from __future__ import annotations

import asyncio
import json
import random
import time

from benchmarks.fleet_workload import Request

REPLICA_HEADER = "x-loraserve-replica"


def prompt_ids(request_index: int, length: int, vocab_size: int, seed: int) -> list[int]:
    """Random token ids, the same for both routings and new to every run (no prefix-cache hits across them)."""
    rng = random.Random(seed * 1_000_003 + request_index)
    return [rng.randrange(2, vocab_size) for _ in range(length)]


async def one_request(session, url: str, model: str, request: Request, prompt: list[int], start: float,
                      deadline: float) -> dict:
    await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
    sent = time.perf_counter()
    record = {"adapter": request.adapter, "at": request.at, "sent": sent - start, "replica": None, "tokens": 0,
              "expected": request.output_tokens, "first": None, "last": None, "end": None, "outcome": "lost",
              "error": None}
    body = {"model": f"{model}:{request.adapter}", "prompt": prompt, "max_tokens": request.output_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    done = False
    try:
        async with asyncio.timeout(max(0.1, deadline - time.perf_counter())):
            async with session.post(f"{url}/v1/completions", json=body) as response:
                record["replica"] = response.headers.get(REPLICA_HEADER)
                if response.status != 200:
                    record["outcome"] = "error"
                    record["error"] = f"HTTP {response.status}: {(await response.text())[:160]}"
                    return _ended(record, start)
                async for raw in response.content:
                    line = raw.decode().strip()
                    if line == "data: [DONE]":
                        done = True
                    if not line.startswith("data:") or done:
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        record["outcome"], record["error"] = "error", str(event["error"])[:160]
                        return _ended(record, start)
                    if event.get("choices"):
                        now = time.perf_counter() - start
                        record["first"] = record["first"] if record["first"] is not None else now
                        record["last"] = now
                    if event.get("usage"):
                        record["tokens"] = event["usage"]["completion_tokens"]
    except TimeoutError:
        record["error"] = "no answer by the run's deadline"
        return _ended(record, start)
    except Exception as exc:  # noqa: BLE001  (a dropped connection: counted as lost, never raised)
        record["error"] = f"{type(exc).__name__}: {exc}"[:160]
        return _ended(record, start)
    if done and record["tokens"] == request.output_tokens and record["first"] is not None:
        record["outcome"] = "ok"
    else:
        record["error"] = f"stream ended after {record['tokens']} of {request.output_tokens} tokens (done={done})"
    return _ended(record, start)


def _ended(record: dict, start: float) -> dict:
    record["end"] = time.perf_counter() - start
    return record


async def drive(url: str, model: str, requests: list[Request], prompts: list[list[int]], drain_s: float,
                on_start=None) -> tuple[list[dict], float]:
    """Send every request at its time; a request unanswered `drain_s` after the last arrival is lost.
    `on_start(start)` is called once the run's clock starts (the benchmark's pollers and faults use it)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)   # open loop: no client-side cap on concurrent requests
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        deadline = start + (requests[-1].at if requests else 0.0) + drain_s
        if on_start is not None:
            on_start(start)
        records = await asyncio.gather(*(one_request(session, url, model, r, p, start, deadline)
                                         for r, p in zip(requests, prompts)))
        return list(records), time.perf_counter() - start
