"""OpenAI response bytes, made in the LLM replica: SSE events of a stream (joined per window, `batched`) and the
body of a whole answer.

The ingress parses and validates a request and hands the replica a `RenderSpec` (what of the
request shapes its response); the replica renders its choices here, so what crosses Ray is a
string per step window instead of a rich object per token (Ray Serve LLM's replica does the
same). The ingress only relays: a stream's events as they come, and a whole answer's body joined
from each prompt's rendered choices (`join_body`, string joins, no JSON parsing).

Encodings are kept as they were when the ingress made them: SSE events as `json.dumps` writes
them, whole bodies as Starlette's JSONResponse does (compact, UTF-8, no NaN).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from typing import Any, AsyncIterator

from deployments import responses as rs
from deployments.reasoning import ReasoningParser, reasoning_fields, split_reasoning
from deployments.tool_calls import ToolCallParser, parse_tool_calls
from workers.reasoning import ThinkTokens

DONE = "data: [DONE]\n\n"
_body_json = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@dataclasses.dataclass(frozen=True)
class RenderSpec:
    """What the ingress read from a request that shapes its response (small and picklable)."""
    chat: bool
    model: str                           # as the caller named it (echoed in every body)
    logprobs: bool = False               # the request wants logprobs (completions: logprobs=N; chat: logprobs)
    echo: bool = False                   # completions: the prompt before the completion
    token_ids_as_names: bool = False     # vLLM's return_tokens_as_token_ids
    tool_calls: bool = False             # chat: the output's tool calls are parsed into tool_calls
    include_usage: bool = False          # stream: a last chunk with the usage
    continuous_usage: bool = False       # stream: the usage so far on every chunk (vLLM's continuous_usage_stats)
    score_prompt: bool = False           # completions' max_tokens 0 with echo: the prompt only, nothing generated
    include_reasoning: bool = True       # chat with a reasoning parser: the reasoning shown (vLLM's field)
    first_index: int = 0                 # completions with several prompts: prompt p's choices start at p * n

    @classmethod
    def of(cls, body, chat: bool) -> RenderSpec:
        """From a validated protocol.CompletionRequest / ChatCompletionRequest."""
        return cls(chat=chat, model=body.model, logprobs=body.wants_logprobs, echo=getattr(body, "echo", False),
                   token_ids_as_names=body.return_tokens_as_token_ids,
                   tool_calls=chat and body.parses_tool_calls, include_usage=body.include_usage,
                   continuous_usage=body.continuous_usage, score_prompt=getattr(body, "score_prompt", False),
                   include_reasoning=getattr(body, "include_reasoning", True))

    def new_id(self) -> str:
        return rs.new_id("chatcmpl" if self.chat else "cmpl")   # not the request id: that names the helper

    # LLMServer renders through its spec: a Responses request's (deployments/responses_render.py) has the same two
    def stream_renderer(self, think: ThinkTokens | None) -> StreamRenderer:
        return StreamRenderer(self, think)

    def render(self, outs: list, replica_id: str, think: ThinkTokens | None) -> RenderedChoices:
        return render_choices(outs, self, replica_id, think)


@dataclasses.dataclass(frozen=True)
class RenderedChoices:
    """One replica call's choices of a whole answer: their JSON (comma-joined) and what the usage needs."""
    choices_json: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    replica_id: str


def render_choices(outs: list, spec: RenderSpec, replica_id: str, think: ThinkTokens | None = None) -> RenderedChoices:
    """The finished choices of one prompt (ServedOutputs, `index` 0..n-1) as OpenAI choice objects; `think`: the
    reasoning parser's tags (deployments/reasoning.py), chat only."""
    choices = []
    outs = [_prompt_only(out) for out in outs] if spec.score_prompt else outs
    for out in outs:
        if spec.token_ids_as_names:
            rs.name_tokens_by_id(out)
        if spec.chat:
            reasoning, content = None, out.text
            if think is not None:   # an output cut in its reasoning has no content (vLLM's)
                reasoning, content = split_reasoning(think, out.prompt_token_ids, out.text)
                content = content or None
            content, calls = parse_tool_calls(content or "") if spec.tool_calls else (content, [])
            choices.append(rs.chat_choice(out.index, content, rs.tool_finish_reason(rs.finish_reason(out), len(calls)),
                                          rs.chat_logprobs(out) if spec.logprobs else None, calls,
                                          reasoning if spec.include_reasoning else None))
        else:
            logprobs = rs.completion_logprobs(out, echo=spec.echo) if spec.logprobs else None
            choices.append(rs.completion_choice(spec.first_index + out.index, (out.prompt_text or "") + out.text,
                                                rs.finish_reason(out), logprobs))
    return RenderedChoices(",".join(_body_json(c) for c in choices), outs[0].num_prompt_tokens,
                           sum(len(o.token_ids) for o in outs), outs[0].num_cached_tokens, replica_id)


def _prompt_only(out):
    """A scored prompt's choice: the one token generated with its logprobs is not part of the answer (vLLM's)."""
    return dataclasses.replace(out, token_ids=[], text="", logprobs=[],
                               top_logprobs=None if out.top_logprobs is None else [])


def join_body(spec: RenderSpec, parts: list[RenderedChoices]) -> bytes:
    """The whole answer's JSON body from each prompt's rendered choices, in order (one id for all)."""
    usage = rs.usage(sum(p.prompt_tokens for p in parts), sum(p.completion_tokens for p in parts),
                     sum(p.cached_tokens for p in parts))
    make_body = rs.chat_body if spec.chat else rs.completion_body
    body = make_body(spec.new_id(), spec.model, [], usage)
    choices = "[" + ",".join(p.choices_json for p in parts if p.choices_json) + "]"
    fields = (f"{_body_json(key)}:{choices if key == 'choices' else _body_json(value)}" for key, value in body.items())
    return ("{" + ",".join(fields) + "}").encode()


class StreamRenderer:
    """A stream's SSE events: `feed(item)` for each delta (ServedOutput, any choice), then `finish()`.

    Per choice it keeps what later events depend on: whether the chat role chunk was sent, the text
    offset of completions' logprobs, the reasoning parser (`think`: its tags, chat only) and the
    tool-call parser (text inside a call is held until the call is complete), which reads the content
    after the reasoning. An error is not rendered here: the ingress reports it in-band (it also sees
    the errors of a replica that died).
    """

    def __init__(self, spec: RenderSpec, think: ThinkTokens | None = None):
        self.spec = spec
        self._think = think if spec.chat else None
        self.response_id = spec.new_id()
        self._make_body = rs.chat_body if spec.chat else rs.completion_body
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self._started: set[int] = set()
        self._offsets: dict[int, int] = {}
        self._parsers: dict[int, ToolCallParser] = {}
        self._reasoners: dict[int, ReasoningParser] = {}

    def _event(self, choices: list[dict], usage: dict | None = None) -> str:
        if usage is None and self.spec.continuous_usage:
            usage = self._usage()
        return f"data: {json.dumps(self._make_body(self.response_id, self.spec.model, choices, usage, chunk=True))}\n\n"

    def _usage(self) -> dict:
        return rs.usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def feed(self, item) -> str:
        spec, i, events = self.spec, item.index, []
        if not self._started:   # the request's first item: its prompt's counts
            self.prompt_tokens, self.cached_tokens = item.num_prompt_tokens, item.num_cached_tokens
        if spec.score_prompt:
            item = _prompt_only(item)
        if spec.token_ids_as_names:
            rs.name_tokens_by_id(item)
        if spec.chat and i not in self._started:
            events.append(self._event([rs.chat_chunk_choice(i, {"role": "assistant", "content": ""}, None)]))
            if self._think is not None:   # a choice's first item carries the prompt
                self._reasoners[i] = ReasoningParser(self._think, item.prompt_token_ids)
        self._started.add(i)
        self.completion_tokens += len(item.token_ids)
        finish = rs.finish_reason(item)
        echo = not spec.chat and item.prompt_text is not None   # a choice's first item, with echo
        text = (item.prompt_text or "") + item.text
        if not (text or finish or spec.logprobs):
            pass     # tokens whose text is still held back: nothing to show yet
        elif spec.chat:
            events.extend(self._chat_event(item, i, text, finish))
        else:
            logprobs = rs.completion_logprobs(item, echo, self._offsets.get(i, 0)) if spec.logprobs else None
            events.append(self._event([rs.completion_choice(spec.first_index + i, text, finish, logprobs)]))
        self._offsets[i] = self._offsets.get(i, 0) + len(text)
        return "".join(events)

    def _chat_event(self, item, i: int, text: str, finish: str | None) -> list[str]:
        spec = self.spec
        logprobs = rs.chat_logprobs(item) if spec.logprobs else None
        calls, made, reasoning = [], 0, ""
        if self._think is not None:
            reasoner = self._reasoners[i]
            reasoning, text = reasoner.feed(text)
            if finish:
                tail_reasoning, tail = reasoner.finish()
                reasoning, text = reasoning + tail_reasoning, text + tail
            reasoning = reasoning if spec.include_reasoning else ""
        if spec.tool_calls:
            parser = self._parsers.setdefault(i, ToolCallParser())
            made = parser.num_calls
            text, calls = parser.feed(text)
            if finish:
                tail, more = parser.finish()
                text, calls = text + tail, calls + more
            finish = rs.tool_finish_reason(finish, parser.num_calls)
        if not (text or reasoning or calls or finish or logprobs) and (spec.tool_calls or self._think is not None):
            return []   # all of it held back by a parser
        delta: dict[str, Any] = reasoning_fields(reasoning)
        if text or not (finish or calls or reasoning):
            delta["content"] = text
        if calls:
            delta["tool_calls"] = rs.tool_call_deltas(calls, made)
        return [self._event([rs.chat_chunk_choice(i, delta, finish, logprobs)])]

    def finish(self) -> str:
        """After the last item: the usage chunk (when asked) and [DONE]."""
        usage = self._event([], self._usage()) if self.spec.include_usage else ""
        return usage + DONE


# ---- a stream's events, joined per window ---------------------------------------------------------------------
# Every item a replica yields to a streaming handle is one Ray object and one report to the caller,
# whatever its size; the ingress then hands each to its ASGI stream. So the replica sends what is
# ready together: the first item alone and at once (time to first token), then, once something new
# is ready, whatever else arrives within `window_s` joined to it (the other choices' tokens of the
# same engine step, a stop's final chunk, or, with a window longer than a step, several steps).
# Ray Serve LLM's LLMServer batches its stream for the same reason (`_batch_output_stream`), on a
# fixed timer; here a quiet stream costs no wake-ups, and a window of 0 still joins what the event
# loop has ready at once.


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
