"""Tool calls in a model's output -> OpenAI `message.tool_calls` / streamed `delta.tool_calls`.

The Qwen3 (hermes) format its chat template teaches the model, one block per call:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text before the first block is the message's content. A block whose JSON is not a call (no string
`name`, `arguments` not an object) stays content, as written. One parser serves both paths: the whole
text fed at once (`parse_tool_calls`) or piece by piece as a stream produces it (`ToolCallParser`),
holding back only what may be the start of `<tool_call>`. Another model family's format is another
parser with the same two methods, chosen by the deployment (docs/structured-output.md).
"""
from __future__ import annotations

import json
import uuid

START, END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(block: str) -> dict | None:
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not (isinstance(data, dict) and isinstance(data.get("name"), str)
            and isinstance(data.get("arguments", {}), dict)):
        return None
    arguments = json.dumps(data.get("arguments", {}), ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": data["name"], "arguments": arguments}}


def _held_back(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of START (it may still become one)."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """feed(text) -> (new content, completed calls); finish() at the end of the output does the same."""

    def __init__(self):
        self._text = ""
        self._pos = 0            # everything before it has been emitted (as content or as a call)
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._text += text
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> tuple[str, list[dict]]:
        content, calls = [], []

        def emit(segment: str) -> None:
            if segment.strip() or not self.num_calls:   # whitespace around calls is not content
                content.append(segment)

        while True:
            start = self._text.find(START, self._pos)
            if start < 0:
                end = len(self._text) if final else len(self._text) - _held_back(self._text[self._pos:])
                emit(self._text[self._pos:end])
                self._pos = end
                break
            emit(self._text[self._pos:start])
            stop = self._text.find(END, start)
            block_end = stop + len(END) if stop >= 0 else len(self._text)
            if stop < 0 and not final:
                self._pos = start
                break
            # an unterminated last block is a call when it parses: generation stopped at END (a stop string)
            call = _call(self._text[start + len(START):stop if stop >= 0 else len(self._text)])
            if call is None:
                content.append(self._text[start:block_end])
            else:
                calls.append(call)
                self.num_calls += 1
            self._pos = block_end
        return "".join(content), calls


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content or None when empty, calls) of a whole output."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    tail, more = parser.finish()
    content = (content + tail).strip()
    return (content or None), calls + more
