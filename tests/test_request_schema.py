"""The strict request schema at the edge, without Ray (deployments/protocol.py): an unknown or unsupported field, a
wrong type or an out-of-range value is a 400 whose message and param name the field, and hides internals; the
fields vLLM's clients send (chat template kwargs, stream usage options, logits processors) are read as vLLM reads
them; harmless and off-valued fields are accepted."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from deployments import protocol as oai
from deployments import utility_requests as utility
from deployments.errors import classify, error_body, message_of

COMPLETION = {"model": "m", "prompt": "x"}
SCHEMA_CASES = [  # (extra fields, HTTP status, code, words the message must hold)
    ({"foo": 1}, 400, "unknown_parameter", ["foo", "unknown field"]),
    ({"top_logprobs": 2}, 400, "unsupported_parameter", ["top_logprobs=2", "not supported"]),
    ({"use_beam_search": True}, 400, "unsupported_parameter", ["use_beam_search"]),
    ({"prompt_logprobs": 1}, 400, "unsupported_parameter", ["prompt_logprobs"]),
    ({"suffix": "x"}, 400, "unsupported_parameter", ["suffix"]),
    ({"echo": "yes"}, 400, "invalid_request", ["echo"]),
    ({"n": 17}, 400, "invalid_request", ["n"]),
    ({"best_of": 1, "n": 2}, 400, "invalid_request", ["best_of"]),
    ({"logit_bias": {"1": "5"}}, 400, "invalid_request", ["logit_bias.1"]),
    ({"min_tokens": 1.5}, 400, "invalid_request", ["min_tokens"]),
    ({"n": True}, 400, "invalid_request", ["n"]),
    ({"stream_options": {"include_usage": True, "foo": 1}}, 400, "unknown_parameter", ["stream_options.foo"]),
    ({"max_tokens": "4"}, 400, "invalid_request", ["max_tokens", "integer"]),
    ({"max_tokens": 4.0}, 400, "invalid_request", ["max_tokens"]),
    ({"prompt": [True, False]}, 400, "invalid_request", ["prompt"]),
    ({"stop_token_ids": [True]}, 400, "invalid_request", ["stop_token_ids.0"]),
    ({"stream": "true"}, 400, "invalid_request", ["stream"]),
    ({"logprobs": True}, 400, "invalid_request", ["logprobs"]),
    ({"temperature": "0.5"}, 400, "invalid_request", ["temperature"]),
    ({"seed": 1 << 70}, 400, "invalid_request", ["seed"]),
    ({"max_tokens": 0}, 400, "invalid_request", ["max_tokens: 0", "echo"]),
    ({"chat_template_kwargs": {"a": 1}}, 400, "unsupported_parameter", ["chat_template_kwargs"]),   # chat's
    ({"include_stop_str_in_output": True}, 400, "unsupported_parameter", ["include_stop_str_in_output"]),
    ({"allowed_token_ids": [1]}, 400, "unsupported_parameter", ["allowed_token_ids"]),
]


@pytest.mark.parametrize("extra, status, code, words", SCHEMA_CASES, ids=[json.dumps(c[0]) for c in SCHEMA_CASES])
def test_the_schema_is_strict_and_names_the_field(extra, status, code, words):
    with pytest.raises(ValidationError) as info:
        oai.CompletionRequest.model_validate_json(json.dumps({**COMPLETION, **extra}))
    assert classify(info.value)[:3:2] == (status, code)
    message = message_of(info.value)
    for word in words:
        assert word in message, message
    assert "https://" not in message and "ChatMessage" not in message and "input_value" not in message


def test_every_schema_error_is_a_400_whose_param_names_the_field():
    for extra, field in [({"max_tokens": "4"}, "max_tokens"), ({"foo": 1}, "foo"), ({"suffix": "x"}, "suffix"),
                         ({"logit_bias": {"1": "5"}}, "logit_bias.1"), ({"prompt": None}, "prompt")]:
        with pytest.raises(ValidationError) as info:
            oai.CompletionRequest.model_validate_json(json.dumps({**COMPLETION, **extra}))
        status, body = error_body(info.value)
        assert status == 400 and body["error"]["param"] == field, body


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def test_chat_template_fields_as_vllm_builds_them():
    def chat(**fields):
        return oai.ChatCompletionRequest.model_validate_json(json.dumps({**CHAT, **fields}))

    assert chat().template_kwargs() == {"add_generation_prompt": True, "continue_final_message": False}
    # the request's own fields over the caller's kwargs; reasoning_effort reaches a template that reads it
    asked = chat(chat_template_kwargs={"enable_thinking": False, "add_generation_prompt": False},
                 reasoning_effort="low").template_kwargs()
    assert asked == {"enable_thinking": False, "add_generation_prompt": True, "continue_final_message": False,
                     "reasoning_effort": "low"}
    assert chat(add_generation_prompt=False, continue_final_message=True).template_kwargs()["continue_final_message"]
    for fields, word in [({"continue_final_message": True}, "add_generation_prompt"),
                         ({"reasoning_effort": "extreme"}, "reasoning_effort"), ({"max_tokens": 0}, "max_tokens"),
                         ({"echo": True}, "echo"), ({"chat_template_kwargs": []}, "chat_template_kwargs")]:
        with pytest.raises(ValidationError) as info:
            chat(**fields)
        assert classify(info.value)[0] == 400 and word in message_of(info.value), fields


def test_stream_usage_options():
    def spec(**options):
        body = oai.CompletionRequest.model_validate_json(json.dumps({**COMPLETION, "stream": True,
                                                                     "stream_options": options}))
        return body.include_usage, body.continuous_usage

    assert spec() == (False, False) and spec(include_usage=True) == (True, False)
    # vLLM's continuous_usage_stats, under its include_usage whose default is true
    assert spec(continuous_usage_stats=True) == (False, True)
    assert spec(include_usage=True, continuous_usage_stats=True) == (True, True)
    assert spec(include_usage=False, continuous_usage_stats=True) == (False, False)


def test_harmless_and_off_valued_fields_are_accepted():
    ok = oai.CompletionRequest.model_validate_json(json.dumps({
        **COMPLETION, "user": "u", "n": 1, "best_of": 1, "top_logprobs": 0, "skip_special_tokens": True,
        "temperature": 0, "presence_penalty": 1, "repetition_penalty": 1.1, "min_p": 0.05, "min_tokens": 1,
        "logit_bias": {"12": -100}}))
    params = ok.to_sampling_params(16)    # the implemented logits processors reach workers.SamplingParams
    assert (ok.temperature, params.presence_penalty, params.repetition_penalty, params.min_p,
            params.min_tokens, params.logit_bias) == (0.0, 1.0, 1.1, 0.05, 1, {12: -100.0})
    with pytest.raises(ValueError, match="token ids"):
        oai.CompletionRequest(model="m", prompt="x", logit_bias={"the": 1}).to_sampling_params(16)
    chat = oai.ChatCompletionRequest.model_validate_json(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi", "name": "bob"}], "metadata": {"k": "v"}}))
    assert chat.chat_messages() == [{"role": "user", "content": "hi"}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    oai.ChatCompletionRequest.model_validate_json(json.dumps({   # an assistant's earlier calls: accepted
        "model": "m", "messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}))
    with pytest.raises(ValidationError, match="tool_calls is only allowed on assistant messages"):
        oai.ChatCompletionRequest.model_validate_json(json.dumps({
            "model": "m", "messages": [{"role": "user", "content": "", "tool_calls": [call]}]}))
    with pytest.raises(ValidationError, match="replace"):
        utility.LoadLoRAAdapterRequest.model_validate_json('{"lora_name": "a", "lora_path": "/a", "replace": "yes"}')
