"""The hermes tool-call parser (whole and streamed alike) and request fields -> one constraint (no Ray)."""
import json

import pytest
from pydantic import ValidationError

from deployments.protocol import ChatCompletionRequest, CompletionRequest
from deployments.tool_calls import ToolCallParser, parse_tool_calls

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1, "s": "é"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g"}}]


def streamed(text: str, step: int) -> tuple[str, list[dict]]:
    parser, content, calls = ToolCallParser(), "", []
    for i in range(0, len(text), step):
        piece, made = parser.feed(text[i:i + step])
        content, calls = content + piece, calls + made
    piece, made = parser.finish()
    return content + piece, calls + made


@pytest.mark.parametrize("text, content, names", [
    ("plain text", "plain text", []),
    (CALL, None, ["f"]),
    ("Let me see.\n" + CALL + "\n" + CALL.replace('"f"', '"g"'), "Let me see.", ["f", "g"]),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n', None, ["f"]),            # cut at the end tag (a stop)
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),   # stays content
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("a <tool", "a <tool", []),                                                         # a held-back prefix, flushed
])
def test_parsed_whole_and_streamed_alike(text, content, names):
    got_content, calls = parse_tool_calls(text)
    assert got_content == content and [c["function"]["name"] for c in calls] == names
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    for step in (1, 3, 7):
        stream_content, stream_calls = streamed(text, step)
        assert (stream_content.strip() or None) == content
        assert [c["function"] for c in stream_calls] == [c["function"] for c in calls]


def test_streaming_holds_back_only_what_may_start_a_call():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool") == ("Hi ", [])
    assert parser.feed("_call>\n{\"name\": \"f\", ") == ("", [])
    content, calls = parser.feed('"arguments": {}}\n</tool_call>')
    assert content == "" and calls[0]["function"] == {"name": "f", "arguments": "{}"}


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw})


def test_request_fields_become_one_constraint():
    assert chat().to_sampling_params().structured is None
    assert chat(tools=TOOLS).to_sampling_params().structured is None                # auto: free text, parsed
    assert chat(tools=TOOLS, tool_choice="none").template_tools() is None               # not shown to the model
    required = chat(tools=TOOLS, tool_choice="required").to_sampling_params().structured
    spec = json.loads(required.value)
    assert required.kind == "tool_calls" and spec["parallel"] and [n for n, _ in spec["tools"]] == ["f", "g"]
    assert spec["tools"][1][1] == {"type": "object", "properties": {}}                  # no parameters: none
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}).to_sampling_params()
    assert json.loads(named.structured.value) == {"parallel": False, "tools": [["g", {"type": "object",
                                                                                            "properties": {}}]]}
    one = chat(tools=TOOLS, parallel_tool_calls=False).to_sampling_params()
    assert one.structured is None and one.stop == ["</tool_call>"]
    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    fmt = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert json.loads(fmt.to_sampling_params().structured.value) == schema          # key order kept
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x",
                                                   "structured_outputs": {"choice": ["a", "b"]}})
    assert completion.to_sampling_params(16).structured.kind == "choice"


@pytest.mark.parametrize("kw, named", [
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}), "'h'"),
    (dict(tools=TOOLS + TOOLS[:1]), "unique"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (dict(structured_outputs={"regex": "a", "grammar": "b"}), "exactly one"),
    (dict(response_format={"type": "json_schema"}), "json_schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}), "name"),
    (dict(messages=[{"role": "user", "content": "x", "tool_calls": []}], tools=TOOLS), None),
    (dict(messages=[{"role": "user", "content": "x", "tool_call_id": "c"}]), "tool_call_id"),
])
def test_bad_fields_are_errors_naming_them(kw, named):
    try:
        chat(**kw).to_sampling_params()
    except (ValueError, ValidationError) as exc:
        assert named is not None and named in str(exc), str(exc)
    else:
        assert named is None


def test_completions_refuse_tools():
    with pytest.raises(ValidationError, match="tools"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "tools": TOOLS})
