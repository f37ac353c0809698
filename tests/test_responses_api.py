"""The Responses API (POST /v1/responses) without Ray: a request translated into the chat completion it means
(messages, tools, tool_choice, text.format, sampling), refusals as 400 bodies naming the field, and the output
rendered from chat outputs, whole and streamed, checked against the openai client's own types (its stream
accumulator too). The end to end checks with the openai client run on test_openai_responses' app."""
from __future__ import annotations

import json
from typing import get_args

import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from deployments.errors import error_body
from deployments.responses_api import ResponsesRequest
from deployments.responses_render import ResponsesStreamRenderer
from deployments.served_output import ServedOutput
from workers.reasoning import ThinkTokens

TAGS = ThinkTokens("<think>", "</think>", 90, 91)
THINKING = [1, 2]
EVENTS = {get_args(kind.model_fields["type"].annotation)[0]: kind   # event type -> the openai client's class of it
          for kind in get_args(get_args(ResponseStreamEvent)[0])}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def check_openai_shape(kind, data: dict) -> None:
    """`data` validates as the openai client's type `kind` (the client itself only constructs). Usage's
    input_tokens_details.cache_write_tokens (OpenAI's explicit cache writes) may be missing: we count none."""
    try:
        TypeAdapter(kind).validate_python(data)
    except ValidationError as invalid:
        errors = [e for e in invalid.errors() if e["loc"][-1] != "cache_write_tokens" or e["type"] != "missing"]
        assert not errors, errors


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"model": "tiny", **fields}))


def refusal(**fields) -> dict:
    with pytest.raises(Exception) as failed:
        request(**fields).chat_request().to_sampling_params()   # as the route does
    status, body = error_body(failed.value)
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    return body["error"]


def test_a_string_input_and_instructions_are_a_system_then_a_user_message():
    chat = request(input="Hi", instructions="Be brief", max_output_tokens=7, temperature=0.5).chat_request()
    assert chat.chat_messages() == [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    params = chat.to_sampling_params()
    assert params.max_tokens == 7 and params.temperature == 0.5 and params.structured is None
    assert request(input="Hi", temperature=None).chat_request().to_sampling_params().temperature == 1.0


def test_earlier_output_items_become_the_chat_turns_they_were():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}],
              "status": "completed"},
             {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
             {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "status": "completed"},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20 C"}]}]
    messages = request(input=items, tools=[WEATHER]).chat_request().chat_messages()
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]   # the reasoning is not shown
    assert messages[1]["content"] == "Looking."
    assert [(c["id"], c["function"]["arguments"]) for c in messages[1]["tool_calls"]] == [
        ("call_1", {"city": "Paris"}), ("call_2", {"city": "Rome"})]
    assert messages[2:] == [{"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                            {"role": "tool", "tool_call_id": "call_2", "content": "20 C"}]


def test_tools_tool_choice_and_text_format_constrain_as_chat_completions_do():
    chat = request(input="Hi", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}).chat_request()
    assert chat.template_tools() == [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                                        if k != "type"}}]
    assert chat.to_sampling_params().structured.kind == "tool_calls" and chat.parses_tool_calls
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    chat = request(input="Hi", text=text).chat_request()
    assert chat.to_sampling_params().structured.kind == "json_schema"
    forced = request(input="Hi", text=text, tools=[WEATHER], tool_choice="required").chat_request()
    assert forced.to_sampling_params().structured.kind == "tool_calls"   # no message left for text.format
    auto = request(input="Hi", text=text, tools=[WEATHER], tool_choice="auto").chat_request()
    assert auto.to_sampling_params().structured.kind == "json_schema" and auto.template_tools()
    assert request(input="Hi", tools=[WEATHER], tool_choice="none").chat_request().template_tools() is None
    spec = request(input="Hi", tools=[WEATHER], tool_choice="required", include=[], user="u").render_spec(
        request(input="Hi", tools=[WEATHER], tool_choice="required").chat_request())
    assert spec.tool_calls and spec.echoed["tools"] == [WEATHER] and spec.echoed["tool_choice"] == "required"


@pytest.mark.parametrize("fields, param, says", [
    ({"store": True}, "store", "keeps no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"modalities": ["text"]}, "modalities", "unknown field"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"input": [{"role": "user", "content": "Hi", "bogus": 1}]}, "input.0.bogus", "unknown field"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type",
     "input_text"),
    ({"input": [{"type": "computer_call"}]}, "input.0", "input item"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id", "required"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
    ({"tool_choice": "required"}, None, "tool_choice needs tools"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format", "schema"),
    ({"reasoning": {"summary": "auto"}}, "reasoning", 'summary="auto" is not supported'),
])
def test_what_is_not_served_is_a_400_naming_it(fields, param, says):
    error = refusal(**{"input": "Hi", **fields})
    assert error["param"] == param and says in error["message"], error


def output(text: str, token_ids=(5,), prompt_ids=(), finish=None) -> ServedOutput:
    return ServedOutput("r", list(prompt_ids), list(token_ids), text, [-0.5] * len(token_ids), finish,
                        num_prompt_tokens=4, replica_id="rep", num_cached_tokens=2)


def spec(tools: bool = True):
    return request(input="Hi", tools=[WEATHER] if tools else None).render_spec(
        request(input="Hi", tools=[WEATHER] if tools else None).chat_request())


def stream_events(pieces: list[tuple[str, list[int]]], prompt, finish="stop", tools=True) -> list[dict]:
    renderer = ResponsesStreamRenderer(spec(tools), TAGS)
    last = len(pieces) - 1
    text = "".join(renderer.feed(output(t, ids, prompt if i == 0 else (), finish if i == last else None))
                   for i, (t, ids) in enumerate(pieces)) + renderer.finish()
    chunks = text.split("\n\n")[:-1]
    assert all(c.startswith("event: ") for c in chunks)
    data = [json.loads(c.split("\ndata: ", 1)[1]) for c in chunks]
    assert [c.split("\n")[0][7:] for c in chunks] == [d["type"] for d in data]
    return data


def test_a_stream_is_openais_event_sequence_and_accumulates_to_the_whole_response():
    pieces = [("I will", [7, 8]), (" call </th", [9, 91]), ("ink>Sure", [10]), (CALL[:15], [11]), (CALL[15:], [12])]
    data = stream_events(pieces, THINKING)
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    for event in data:   # the openai client's own types and its stream accumulator take every event
        check_openai_shape(EVENTS[event["type"]], event)
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = data[-1]["response"]
    reasoning, message, call = final["output"]
    assert "".join(d["delta"] for d in data if d["type"] == "response.reasoning_text.delta") == "I will call "
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I will call "}]
    assert message["content"][0]["text"] == "Sure" == "".join(
        d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert (call["name"], json.loads(call["arguments"]), call["call_id"].startswith("call_")) == (
        "get_weather", {"city": "Paris"}, True)
    assert final["status"] == "completed" and final["usage"] == {
        "input_tokens": 4, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 4}, "total_tokens": 11}
    check_openai_shape(Response, final)


def test_whitespace_before_a_call_is_no_message_and_a_cut_output_is_incomplete():
    data = stream_events([("\n", [3]), (CALL, [4])], [1, 90, 91])   # the think block closed in the prompt
    assert [item["type"] for item in data[-1]["response"]["output"]] == ["function_call"]
    cut = stream_events([("The answer", [3, 4])], [1, 90, 91], finish="length", tools=False)
    final = cut[-1]
    assert final["type"] == "response.incomplete" and final["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_the_whole_response_has_the_streams_output():
    text = "I will</think>Sure" + CALL
    rendered = spec().render([output(text, [7, 91, 8, 9], THINKING, "stop")], "rep", TAGS)
    body = json.loads(rendered.body)
    check_openai_shape(Response, body)
    assert rendered.replica_id == "rep" and body["status"] == "completed" and body["object"] == "response"
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][1]["content"][0]["text"] == "Sure" and body["usage"]["output_tokens_details"] == {
        "reasoning_tokens": 2}
    assert body["tools"] == [WEATHER] and body["store"] is False and body["temperature"] == 1.0
