"""LangChain (langchain-openai's ChatOpenAI) against the server: invoke and stream, structured output, a forced
tool call answered by a ToolMessage turn. Runs in the clients' venv (benchmarks/clients/run.py); prints one JSON
row per check. The demo model is random, so each check asserts the protocol (parsed, valid, within the schema's
bounds), never the text."""
from __future__ import annotations

import argparse
import json
from typing import Literal

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field, ValidationError


class City(BaseModel):
    name: str = Field(max_length=12)    # a bound the grammar must keep in characters, as JSON counts them
    country: Literal["FR", "DE", "JP"]
    capital: bool


class WeatherQuery(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


@tool(args_schema=WeatherQuery)
def get_weather(city: str, unit: str) -> str:
    """The current weather in a city."""
    return f"18 degrees {unit} in {city}"


def valid(model: type[BaseModel], value: dict | BaseModel | None) -> bool:
    """Validates against the schema and holds no U+FFFD (the mark of undecodable bytes in a constrained string)."""
    try:
        parsed = model.model_validate(value if isinstance(value, dict) else dict(value or {}))
    except (ValidationError, TypeError):
        return False
    return "\ufffd" not in parsed.model_dump_json()


def invoke_and_stream(llm: ChatOpenAI) -> str:
    answer = llm.invoke("Say hello.")
    chunks = list(llm.stream("Say hello."))
    assert isinstance(answer.content, str) and answer.usage_metadata, "no content or usage in the answer"
    assert chunks and any(c.content for c in chunks), "the stream had no content chunk"
    return f"invoke {answer.usage_metadata['output_tokens']} tokens, stream {len(chunks)} chunks"


def structured_output(llm: ChatOpenAI, trials: int) -> str:
    structured = llm.with_structured_output(City, method="json_schema", include_raw=True)
    invalid, example = 0, ""
    for _ in range(trials):
        try:   # the openai client's parse raises on an output the schema refuses; include_raw catches the rest
            result = structured.invoke("Name a city.")
            ok = result["parsing_error"] is None and valid(City, result["parsed"])
            example = example or ("" if ok else repr(result["raw"].content))
        except ValidationError as exc:
            ok, example = False, example or str(exc).splitlines()[2].strip()
        invalid += not ok
    assert invalid == 0, f"{invalid} of {trials} outputs invalid (schema, maxLength 12 or U+FFFD), e.g. {example}"
    return f"{trials} of {trials} valid (json_schema, maxLength 12)"


def tool_two_turns(llm: ChatOpenAI, trials: int) -> str:
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    follow_up = llm.bind_tools([get_weather])
    invalid, example = 0, ""
    for _ in range(trials):
        question = HumanMessage("What is the weather in Paris?")
        call_message = forced.invoke([question])
        calls = call_message.tool_calls
        if len(calls) != 1 or calls[0]["name"] != "get_weather" or not valid(WeatherQuery, calls[0]["args"]):
            invalid += 1
            example = example or repr(calls or call_message.invalid_tool_calls)
            continue
        result = ToolMessage(get_weather.invoke(calls[0]["args"]), tool_call_id=calls[0]["id"])
        answer = follow_up.invoke([question, call_message, result])
        assert isinstance(answer.content, str), "the turn after the ToolMessage has no content"
    assert invalid == 0, (f"{invalid} of {trials} tool calls missing or invalid (schema, maxLength 12 or U+FFFD), "
                          f"e.g. {example}")
    return f"{trials} calls valid, {trials} ToolMessage turns answered"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    llm = ChatOpenAI(base_url=args.base_url, api_key="unused", model=args.model, max_tokens=256, temperature=1.0,
                     timeout=30, max_retries=0, stream_usage=True)
    checks = {"LangChain invoke + stream": lambda: invoke_and_stream(llm),
              "LangChain structured output": lambda: structured_output(llm, args.trials),
              "LangChain tool call + ToolMessage turn": lambda: tool_two_turns(llm, args.trials)}
    for name, check in checks.items():
        try:
            row = {"check": name, "ok": True, "detail": check()}
        except Exception as exc:  # noqa: BLE001  (a client's failure is this check's result)
            row = {"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
