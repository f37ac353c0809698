"""The OpenAI Agents SDK against the server: an agent with a function tool on the SDK's default model (the
Responses API, `POST /v1/responses`), run and streamed, and on chat completions (`OpenAIChatCompletionsModel`).
Runs in the clients' venv (benchmarks/clients/run.py); prints one JSON row per check. The tool is forced on
the first turn, so each run is: a function call whose arguments the SDK validates, the tool, then a turn
that reads its output (`function_call_output`) and answers.

On the Responses API the agent has an `output_type`: the random demo model seldom ends a free text, and a
response cut at `max_output_tokens` is `incomplete`, which the SDK raises on (as with OpenAI's API); the
schema ends the answer. Chat completions' `finish_reason: length` the SDK accepts, and there a
`response_format` with a forced tool is a 400 (each constrains the whole output), so that agent has none."""
from __future__ import annotations

import argparse
import asyncio
import json
from typing import Annotated, Literal

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_default_openai_client, set_tracing_disabled)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

CALLS: list[dict] = []   # the arguments each tool call got, in order


@function_tool(failure_error_function=None)   # arguments the schema refuses raise instead of going back as text
def get_weather(city: Annotated[str, Field(max_length=12)], unit: Literal["celsius", "fahrenheit"]) -> str:
    """The current weather in a city."""
    CALLS.append({"city": city, "unit": unit})
    return f"18 degrees {unit} in {city}"


class Answer(BaseModel):
    summary: Annotated[str, Field(max_length=24)]


def weather_agent(model, output_type: type[BaseModel] | None = None) -> Agent:
    return Agent(name="weather", instructions="Answer with the weather tool.", model=model, tools=[get_weather],
                 output_type=output_type,
                 model_settings=ModelSettings(tool_choice="get_weather", max_tokens=256, temperature=1.0))


async def run_agent(agent: Agent, trials: int, streamed: bool) -> str:
    del CALLS[:]
    events = responses = 0
    expected = agent.output_type or str
    for _ in range(trials):
        if streamed:
            result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
            events += sum([1 async for _ in result.stream_events()])
        else:
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        assert isinstance(result.final_output, expected), f"final output {result.final_output!r}"
        responses += len(result.raw_responses)
    assert len(CALLS) == trials, f"{len(CALLS)} tool calls in {trials} runs"
    bad = [call for call in CALLS if "\ufffd" in call["city"]]
    assert not bad, f"{len(bad)} of {trials} tool calls' arguments hold U+FFFD, e.g. {bad[0]}"
    return (f"{trials} runs, {len(CALLS)} tool calls valid, {responses} model responses, final output "
            f"{expected.__name__}" + (f", {events} stream events" if streamed else ""))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    set_tracing_disabled(True)   # the SDK would export traces to OpenAI's servers
    client = AsyncOpenAI(base_url=args.base_url, api_key="unused", timeout=30, max_retries=0)
    set_default_openai_client(client, use_for_tracing=False)
    checks = {
        "Agents SDK, Responses (default)": run_agent(weather_agent(args.model, Answer), args.trials, streamed=False),
        "Agents SDK, Responses streamed": run_agent(weather_agent(args.model, Answer), args.trials, streamed=True),
        "Agents SDK, chat completions": run_agent(
            weather_agent(OpenAIChatCompletionsModel(model=args.model, openai_client=client)), args.trials, False),
    }
    for name, check in checks.items():
        try:
            row = {"check": name, "ok": True, "detail": await check}
        except Exception as exc:  # noqa: BLE001  (a client's failure is this check's result)
            row = {"check": name, "ok": False, "detail": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
