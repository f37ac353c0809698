"""OpenAI Responses API bodies and stream events (POST /v1/responses), made in the LLM replica from the chat
path's outputs.

The replica renders the bytes, as it does for chat (deployments/render.py): a `ResponsesSpec` takes the place
of a RenderSpec in LLMServer.render_choices / render_stream, so the generation, the reasoning parser and the
tool-call parser are the chat path's own, and only the shapes differ. One answer (`n` is 1) becomes output
items in order: a `reasoning` item (a thinking model's reasoning, as `reasoning_text` content), a `message`
with one `output_text` part, then one `function_call` per tool call. A stream sends OpenAI's events:
`response.created`, `response.in_progress`, per item `response.output_item.added` ... `.done` with its
content parts and deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta` / `.done`), and last `response.completed` (`response.incomplete`
when max_output_tokens cut it), which carries the whole response, usage included. Every event has its
`sequence_number`; nothing follows the last one (no `[DONE]`, as OpenAI's).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from deployments import responses as rs
from deployments.reasoning import ReasoningParser, split_reasoning
from deployments.tool_calls import ToolCallParser, parse_tool_calls
from workers.reasoning import ThinkTokens


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclasses.dataclass(frozen=True)
class ResponsesSpec:
    """What shapes a Responses answer (small and picklable); made by responses_api.ResponsesRequest."""
    model: str                              # as the caller named it
    tool_calls: bool                        # the output's tool calls are parsed into function_call items
    echoed: dict[str, Any]                  # the request's settings every response object repeats
    echo: bool = False                      # (read by LLMServer for chat and completions: never here)
    logprobs: bool = False

    def stream_renderer(self, think: ThinkTokens | None) -> ResponsesStreamRenderer:
        return ResponsesStreamRenderer(self, think)

    def render(self, outs: list, replica_id: str, think: ThinkTokens | None) -> RenderedResponse:
        """The whole response's body of the one finished output."""
        [out] = outs
        reasoning, content = (None, out.text) if think is None else split_reasoning(think, out.prompt_token_ids,
                                                                                     out.text)
        content, calls = parse_tool_calls(content) if self.tool_calls else (content, [])
        output = [reasoning_item(new_id("rs"), reasoning, "completed")] if reasoning else []
        if content and content.strip():
            output.append(message_item(new_id("msg"), content, "completed"))
        output += [function_call_item(call, "completed") for call in calls]
        if rs.finish_reason(out) == "length" and output and output[-1]["type"] != "function_call":
            output[-1]["status"] = "incomplete"   # cut by max_output_tokens (a cut call is no call)
        used = usage(out.num_prompt_tokens, len(out.token_ids), out.num_cached_tokens,
                     reasoning_tokens(think, out.prompt_token_ids, out.token_ids))
        body = response_object(self, new_id("resp"), int(time.time()), output, used, rs.finish_reason(out))
        return RenderedResponse(json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")),
                                replica_id)


@dataclasses.dataclass(frozen=True)
class RenderedResponse:
    body: str
    replica_id: str


def response_object(spec: ResponsesSpec, response_id: str, created_at: int, output: list[dict],
                    usage_: dict | None, finish: str | None) -> dict[str, Any]:
    """OpenAI's Response: `finish` None is in progress, "length" incomplete (max_output_tokens), else completed."""
    status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "model": spec.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage_, **spec.echoed}


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens_: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens_},
            "total_tokens": input_tokens + output_tokens}


def reasoning_tokens(think: ThinkTokens | None, prompt_token_ids, token_ids) -> int:
    """The output's tokens up to and including the reasoning's end tag (all of them when it never ended)."""
    if think is None or think.reasoning_ended(prompt_token_ids):
        return 0
    return token_ids.index(think.end_id) + 1 if think.end_id in token_ids else len(token_ids)


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(call: dict, status: str, item_id: str | None = None, arguments: str | None = None) -> dict:
    """A parsed tool call (deployments/tool_calls.py) as a function_call item."""
    function = call["function"]
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"] if arguments is None else arguments, "status": status}


_ITEMS = {"reasoning": reasoning_item, "message": message_item}


class ResponsesStreamRenderer:
    """A stream's events: `feed(item)` for each delta of the one choice, then `finish()` (LLMServer.render_stream).

    The reasoning parser and the tool-call parser are the chat stream's (deployments/render.py); what they
    let out opens, extends or closes an output item. Text that is only whitespace before any message opens
    is held (a message of whitespace is no message, as in the whole response) and goes out with what follows.
    """

    def __init__(self, spec: ResponsesSpec, think: ThinkTokens | None):
        self.spec, self._think = spec, think
        self.response_id, self.created_at = new_id("resp"), int(time.time())
        self._sequence = 0
        self._output: list[dict] = []      # finished items
        self._open: dict | None = None     # the reasoning or message item being streamed, and its text so far
        self._held = ""
        self._reasoner: ReasoningParser | None = None
        self._calls = ToolCallParser() if spec.tool_calls else None
        self._counts = [0, 0, 0, 0]        # input, output, cached, reasoning tokens
        self._thinking = False             # the output is still in its reasoning (its tokens are counted so)
        self._finish: str | None = None

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"

    def _response(self, finish: str | None) -> dict:
        used = usage(*self._counts) if finish is not None else None
        return response_object(self.spec, self.response_id, self.created_at, self._output, used, finish)

    def feed(self, item) -> str:
        events = []
        if self._sequence == 0:   # the first item carries the prompt
            self._counts[0], self._counts[2] = item.num_prompt_tokens, item.num_cached_tokens
            if self._think is not None:
                self._reasoner = ReasoningParser(self._think, item.prompt_token_ids)
                self._thinking = not self._think.reasoning_ended(item.prompt_token_ids)
            events += [self._event("response.created", response=self._response(None)),
                       self._event("response.in_progress", response=self._response(None))]
        self._count(item.token_ids)
        finish = rs.finish_reason(item)
        reasoning, content = self._reasoner.feed(item.text) if self._reasoner else ("", item.text)
        if finish and self._reasoner:
            tail_reasoning, tail = self._reasoner.finish()
            reasoning, content = reasoning + tail_reasoning, content + tail
        calls = []
        if self._calls is not None:
            content, calls = self._calls.feed(content)
            if finish:
                tail, more = self._calls.finish()
                content, calls = content + tail, calls + more
        if reasoning:
            events += self._extend("reasoning", reasoning)
        if content:
            events += self._extend("message", content)
        for call in calls:
            events += self._close() + self._function_call(call)
        self._finish = finish or self._finish
        return "".join(events)

    def _count(self, token_ids: list[int]) -> None:
        self._counts[1] += len(token_ids)
        if self._thinking:
            self._thinking = self._think.end_id not in token_ids
            self._counts[3] += len(token_ids) if self._thinking else token_ids.index(self._think.end_id) + 1

    def _extend(self, kind: str, text: str) -> list[str]:
        events = []
        if self._open is None or self._open["type"] != kind:
            if kind == "message" and not (self._held + text).strip():
                self._held += text
                return []
            events += self._close() + self._start(kind)
        if kind == "message":
            text, self._held = self._held + text, ""
        where = dict(item_id=self._open["id"], output_index=len(self._output), content_index=0)
        self._open["text"] += text
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **where, delta=text)]
        return events + [self._event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def _start(self, kind: str) -> list[str]:
        self._open = {"type": kind, "id": new_id("rs" if kind == "reasoning" else "msg"), "text": ""}
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
        return [self._event("response.output_item.added", output_index=len(self._output),
                            item=_ITEMS[kind](self._open["id"], None, "in_progress")),
                self._event("response.content_part.added", item_id=self._open["id"], output_index=len(self._output),
                            content_index=0, part=part)]

    def _close(self) -> list[str]:
        """The open reasoning or message item's done events; it joins the output."""
        if self._open is None:
            return []
        opened, self._open = self._open, None
        status = "incomplete" if self._finish == "length" else "completed"
        item = _ITEMS[opened["type"]](opened["id"], opened["text"], status)
        where = dict(item_id=opened["id"], output_index=len(self._output), content_index=0)
        if opened["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=opened["text"])
        else:
            done = self._event("response.output_text.done", **where, text=opened["text"], logprobs=[])
        events = [done, self._event("response.content_part.done", **where, part=item["content"][0]),
                  self._event("response.output_item.done", output_index=len(self._output), item=item)]
        self._output.append(item)
        return events

    def _function_call(self, call: dict) -> list[str]:
        index, item_id = len(self._output), new_id("fc")
        where = dict(item_id=item_id, output_index=index)
        item = function_call_item(call, "completed", item_id)
        self._output.append(item)
        return [self._event("response.output_item.added", output_index=index,
                            item=function_call_item(call, "in_progress", item_id, arguments="")),
                self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def finish(self) -> str:
        """After the last item: the open item's done events and the whole response."""
        events = self._close()
        response = self._response(self._finish or "stop")
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return "".join(events) + self._event(kind, response=response)
