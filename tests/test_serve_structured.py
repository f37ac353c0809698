"""Structured output and tool calling end to end with the openai client (Serve on loopback, one replica):
a random-weight model writes nonsense unless constrained, so every output that ends by itself must parse
and validate, with and without an adapter, streamed and not."""
from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from factories import make_adapter

BASE = "tiny"
MAX_TOKENS = 160
STR8 = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": STR8, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": STR8, "address": {"type": "object", "properties": {
            "city": STR8, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
        "required": ["name", "address"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"]},
    {"type": "boolean"},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0},
                                                                 "ok": {"type": "boolean"}},
                                "required": ["id", "ok"]}, "minItems": 1, "maxItems": 2},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer"}},
     "required": ["kind", "x"]},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                "maxItems": 2}, "minItems": 1, "maxItems": 2},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                      "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
     "required": ["start", "end"]},
    {"type": ["integer", "null"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    {"type": "string", "pattern": "^[a-z]{2,6}$"},
    {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}, "n": {"type": "integer"}}, "required": ["t", "n"]},
               {"type": "object", "properties": {"t": {"const": "b"}, "s": STR8}, "required": ["t", "s"]}]},
    {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"type": "string", "maxLength": 3},
                                      "r": {"type": "boolean"}}, "additionalProperties": False},
    {"type": "object", "properties": {"scores": {"type": "array", "items": {
        "type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 4}}, "required": ["scores"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "object", "properties": {"child": {"anyOf": [{"type": "object", "properties": {"v": {"type": "integer"}},
                                                           "required": ["v"]}, {"type": "null"}]}},
     "required": ["child"]},
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def url(model_dir, tmp_path_factory, shared_serve):
    from ray import serve

    from deployments.app import build_app

    model = model_dir("qwen3", max_position_embeddings=2048)   # the tools' signatures: ~700 prompt tokens
    adapter = make_adapter(model, tmp_path_factory.mktemp("structured") / "a", r=8, seed=1)
    serve.run(build_app(dict(model=str(model), served_model_name=BASE, adapters={"a": str(adapter)},
                             device="cpu", max_model_len=2048, max_lora_rank=8, max_ongoing_requests=64)),
              name="structured", route_prefix="/")
    return shared_serve


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat(client, model: str, stream: bool, **kw) -> list[tuple[str | None, list[dict], str]]:
    """(content, tool calls as dicts, finish_reason) per choice, streamed or not."""
    if not stream:
        response = client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES), **kw)
        return [(c.message.content, [t.model_dump() for t in c.message.tool_calls or []], c.finish_reason)
                for c in response.choices]
    content, calls, finish = {}, {}, {}
    for chunk in client.chat.completions.create(model=model, messages=kw.pop("messages", MESSAGES), stream=True, **kw):
        for c in chunk.choices:
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
            for call in c.delta.tool_calls or []:
                entry = calls.setdefault(c.index, {}).setdefault(call.index, {"id": None, "function": {
                    "name": "", "arguments": ""}})
                entry["id"] = entry["id"] or call.id
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return [(content[i] or None, [calls.get(i, {})[k] for k in sorted(calls.get(i, {}))], finish[i])
            for i in sorted(finish)]


def test_every_schema_validates_with_and_without_adapter_streamed_and_not(client):
    jobs = [(i, model, stream) for i in range(len(SCHEMAS)) for model in (BASE, "a") for stream in (False, True)]

    def run(job):
        i, model, stream = job
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i], "strict": True}}
        return job, chat(client, model, stream, response_format=fmt, temperature=1.0, max_tokens=MAX_TOKENS,
                         seed=i, n=1 if stream else 2)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, jobs))
    stopped = total = 0
    for (i, model, stream), choices in results:
        for content, calls, finish in choices:
            total += 1
            assert not calls and finish in ("stop", "length"), (i, finish)
            if finish == "stop":
                stopped += 1
                jsonschema.validate(json.loads(content), SCHEMAS[i])   # raises (with the schema) when invalid
    assert len(SCHEMAS) >= 20 and stopped >= total * 0.7, (stopped, total)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_and_structured_outputs_on_completions(client, stream):
    kw = dict(model="a", prompt="Hello", max_tokens=MAX_TOKENS, temperature=1.0, seed=3)
    if stream:
        chunks = list(client.completions.create(stream=True, extra_body={"structured_outputs": {"json": SCHEMAS[7]}},
                                                **kw))
        text = "".join(c.choices[0].text for c in chunks)
        if chunks[-1].choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(text), SCHEMAS[7])
    else:
        out = client.completions.create(extra_body={"response_format": {"type": "json_object"}}, n=3, **kw)
        assert any(c.finish_reason == "stop" for c in out.choices)
        for c in out.choices:
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
    choice = client.completions.create(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **kw)
    assert choice.choices[0].text in ("yes", "no")
    if not stream:   # best_of: every sampled choice constrained, the likeliest returned
        best = client.completions.create(best_of=4, n=2, extra_body={"structured_outputs": {"json": SCHEMAS[14]}},
                                         **kw)
        assert len(best.choices) == 2
        for c in best.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMAS[14])


def check_calls(choices, names, one: bool = False):
    for content, calls, finish in choices:
        if finish == "length":
            continue
        assert finish == "tool_calls" and calls and content is None, (content, calls, finish)
        assert not one or len(calls) == 1
        for call in calls:
            assert call["id"].startswith("call_") and call["function"]["name"] in names
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])
    assert any(finish == "tool_calls" for _, _, finish in choices)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", [BASE, "a"])
def test_required_and_named_tool_choice_always_validate(client, stream, model):
    for seed in range(2):
        kw = dict(tools=TOOLS, temperature=1.0, max_tokens=2 * MAX_TOKENS, seed=seed, n=3)
        check_calls(chat(client, model, stream, tool_choice="required", **kw), PARAMETERS)
        check_calls(chat(client, model, stream, tool_choice="required", parallel_tool_calls=False, **kw),
                    PARAMETERS, one=True)
        named = {"type": "function", "function": {"name": "get_time"}}
        check_calls(chat(client, model, stream, tool_choice=named, **kw), {"get_time"}, one=True)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_a_call_written_in_the_template_format(client, stream):
    forced = r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
    [(content, calls, finish)] = chat(client, BASE, stream, tools=TOOLS, tool_choice="auto", max_tokens=MAX_TOKENS,
                                      extra_body={"structured_outputs": {"regex": forced}})
    assert finish == "tool_calls" and content.strip() == "Let me check." and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER)
    # one call at most with auto: generation ends at the first call's end
    two = forced + r'\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
    [(content, calls, finish)] = chat(client, BASE, stream, tools=TOOLS, parallel_tool_calls=False,
                                      max_tokens=MAX_TOKENS, extra_body={"structured_outputs": {"regex": two}})
    assert finish == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_weather"]
    # tool_choice "none": the same text stays content
    [(content, calls, finish)] = chat(client, BASE, stream, tools=TOOLS, tool_choice="none", max_tokens=MAX_TOKENS,
                                      extra_body={"structured_outputs": {"regex": forced}})
    assert finish == "stop" and not calls and "<tool_call>" in content


def test_tools_are_rendered_and_tool_messages_accepted(client):
    plain = client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1)
    with_tools = client.chat.completions.create(model=BASE, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50   # the template wrote the signatures
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    followed = client.chat.completions.create(model=BASE, messages=conversation, tools=TOOLS, max_tokens=1)
    assert followed.usage.prompt_tokens > with_tools.usage.prompt_tokens


@pytest.mark.parametrize("kw, named", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}), "response_format"),
    (dict(extra_body={"structured_outputs": {"regex": "(("}}), "structured_outputs.regex"),
    (dict(extra_body={"structured_outputs": {"grammar": "root ::= undefined_rule"}}), "structured_outputs.grammar"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}}], tool_choice="required"), "tool_choice"),
    (dict(response_format={"type": "json_object"}, extra_body={"ignore_eos": True}), "ignore_eos"),
])
def test_invalid_constraints_are_a_400_naming_them(client, kw, named):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=8, **kw)
    assert named in caught.value.message, caught.value.message
    assert client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2).choices   # still serving
