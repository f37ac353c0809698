"""The Responses API over HTTP with the official openai client (deployments/responses_api.py translates a request,
responses_render.py renders the answer; their units are test_responses_api.py): a response is the chat completion
with its reasoning item, streamed events join to the final text under a JSON schema, a required function call
streams and its output turn renders as Qwen3's template does, and what we do not serve (store,
previous_response_id, truncation, modalities) is a 400 naming it. test_openai_fields.py's app (tests/fields_app.py:
a thinking model, --reasoning-parser qwen3), deployed under this module's name."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from fields_app import ANSWER, BASE, client, files, hf, scripted, url  # noqa: F401 (fixtures)

APP = "responses"


def responses_args(tokenizer, **extra) -> dict:
    """scripted()'s request on /v1/responses: the same thinking, then the answer (vLLM's logit_bias extension;
    frequency_penalty as in chat completions)."""
    args = scripted(tokenizer)
    return dict(model=args["model"], input="Hi", temperature=0, max_output_tokens=args["max_tokens"],
                extra_body={"logit_bias": args["logit_bias"], "frequency_penalty": args["frequency_penalty"]}, **extra)


def test_responses_create_is_the_chat_completion_with_its_reasoning_item(url, hf):
    _, tokenizer = hf
    chat = client(url).chat.completions.create(**scripted(tokenizer))
    response = client(url).responses.create(**responses_args(tokenizer))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == chat.choices[0].message.reasoning_content
    assert message.type == "message" and response.output_text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.object == "response" and response.model == BASE and response.temperature == 0


def test_responses_stream_events_join_to_the_final_text_in_the_json_schema(url, hf):
    _, tokenizer = hf
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}}
    whole = client(url).responses.create(**responses_args(tokenizer), text=text)
    with client(url).responses.stream(**responses_args(tokenizer), text=text) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    reasoning = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert deltas == final.output_text == whole.output_text and reasoning == whole.output[0].content[0].text
    jsonschema.validate(json.loads(final.output_text), ANSWER)   # text.format holds after the thinking


REPORT = {"type": "function", "name": "report", "description": "Report the answer.", "parameters": ANSWER}


def test_responses_required_function_call_streamed_then_its_output_turn(url, hf):
    _, tokenizer = hf
    args = responses_args(tokenizer, tools=[REPORT], tool_choice="required")
    events = list(client(url).responses.create(**{**args, "max_output_tokens": 96}, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed" and [item.type for item in final.output] == [
        "reasoning", "function_call"]
    call = final.output[1]
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert [event.arguments for event in done] == ["".join(
        event.delta for event in events if event.type == "response.function_call_arguments.delta")] == [call.arguments]
    assert call.name == "report" and call.call_id
    jsonschema.validate(json.loads(call.arguments), ANSWER)   # the grammar held the call to the tool's schema

    # the next turn, as the Agents SDK sends it: the input so far, the output items, the tool's output
    history = [{"role": "user", "content": "Hi"}] + [item.model_dump(exclude_unset=True) for item in final.output]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "recorded"}
    answer = client(url).responses.create(model=f"{BASE}:a", input=history + [output], tools=[REPORT],
                                          max_output_tokens=1, temperature=0)
    template_call = {"id": call.call_id, "type": "function",
                     "function": {"name": "report", "arguments": json.loads(call.arguments)}}
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [template_call]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "recorded"}]
    tools = [{"type": "function", "function": {k: v for k, v in REPORT.items() if k != "type"}}]
    prompt = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nrecorded\n</tool_response>" in prompt   # Qwen3's template: a tool message
    assert answer.usage.input_tokens == len(tokenizer(prompt, add_special_tokens=False).input_ids)
    assert answer.model == f"{BASE}:a" and answer.usage.output_tokens == 1


def test_responses_refuse_what_they_do_not_serve_naming_it(url):
    for field, value in (("store", True), ("previous_response_id", "resp_1"), ("truncation", "auto"),
                         ("modalities", ["text"])):
        response = requests.post(f"{url}/v1/responses", json={"model": BASE, "input": "Hi", field: value}, timeout=60)
        error = response.json()["error"]
        assert response.status_code == 400 and error["type"] == "BadRequestError" and error["param"] == field, error
        assert field in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client(url).responses.create(model=BASE, input="Hi", store=True)
    assert "keeps no responses" in refused.value.body["message"]
