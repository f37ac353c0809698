"""OpenAI response and stream-chunk bodies, logprobs included.

Logprobs name tokens by their text and exact UTF-8 bytes (`ServedOutput.token_names`, made in
the replica, which has the tokenizer): a token that holds part of a character shows U+FFFD in
its text and its true bytes in `bytes`. They are of the model's raw distribution (before
temperature, penalties and the other processors), as vLLM's default.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from deployments.reasoning import reasoning_fields
from workers.sequence import RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(output: RequestOutput) -> str | None:
    """OpenAI knows stop / length; an aborted request stopped."""
    return None if output.finish_reason is None else ("length" if output.finish_reason == "length" else "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:   # OpenAI's field for prompt tokens served from a cache
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _text(out, token_id: int) -> str:
    return out.token_names[token_id][0]


def name_tokens_by_id(out) -> None:
    """vLLM's return_tokens_as_token_ids: every token's text is "token_id:<id>" (exact, whatever it decodes to)."""
    out.token_names = {t: (f"token_id:{t}", raw) for t, (_, raw) in (out.token_names or {}).items()}


def completion_logprobs(out, echo: bool = False, offset: int = 0) -> dict[str, Any]:
    """Legacy completions' logprobs: tokens, their logprobs, the top alternatives, text offsets; with
    `echo`, the prompt's tokens first (the first has no logprob: nothing precedes it)."""
    tokens, logprobs, tops = [], [], []
    wants_top = out.top_logprobs is not None
    if echo:
        for i, token in enumerate(out.prompt_token_ids):
            entry = out.prompt_logprobs[i] if out.prompt_logprobs and i < len(out.prompt_logprobs) else None
            tokens.append(_text(out, token))
            logprobs.append(None if entry is None else entry[0])
            tops.append(None if entry is None else {_text(out, t): lp for t, lp in entry[1]})
            wants_top = wants_top or bool(entry and entry[1])
    for i, token in enumerate(out.token_ids):
        tokens.append(_text(out, token))
        logprobs.append(out.logprobs[i])
        tops.append({_text(out, t): lp for t, lp in out.top_logprobs[i]} if out.top_logprobs is not None else None)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops if wants_top else None,
            "text_offset": offsets}


def _chat_token(out, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = out.token_names[token_id]
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(out) -> dict[str, Any]:
    content = []
    for i, token in enumerate(out.token_ids):
        entry = _chat_token(out, token, out.logprobs[i])
        alternatives = out.top_logprobs[i] if out.top_logprobs is not None else []
        entry["top_logprobs"] = [_chat_token(out, t, lp) for t, lp in alternatives]
        content.append(entry)
    return {"content": content}


def completion_body(request_id: str, model: str, choices: list[dict], usage_: dict | None,
                    chunk: bool = False) -> dict[str, Any]:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_body(request_id: str, model: str, choices: list[dict], usage_: dict | None,
              chunk: bool = False) -> dict[str, Any]:
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_choice(index: int, text: str | None, finish: str | None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    message = {"role": "assistant", "content": text, **reasoning_fields(reasoning)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def tool_finish_reason(finish: str | None, num_calls: int) -> str | None:
    """OpenAI's "tool_calls" when the output ended by itself after making calls (a cut one stays "length")."""
    return "tool_calls" if finish == "stop" and num_calls else finish


def tool_call_deltas(calls: list[dict], first_index: int) -> list[dict]:
    """Streamed calls: each whole (id, name and arguments in one delta), numbered across the choice."""
    return [{"index": first_index + i, **call} for i, call in enumerate(calls)]


def chat_chunk_choice(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}


def model_card(model_id: str, parent: str | None) -> dict[str, Any]:
    # no "root": an adapter's source is a path on the server's disk
    return {"id": model_id, "object": "model", "owned_by": "loraserve", "parent": parent}
