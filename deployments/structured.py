"""Request fields that constrain the output: OpenAI's `response_format`, `tools` / `tool_choice`, and vLLM's
`structured_outputs`, turned into one workers.grammar.StructuredSpec (compiled in the replica, off its step
thread; an invalid schema is a 400 naming the field before anything is queued).

`tool_choice`: "none" (tools are not shown to the model), "auto" (shown; a call the model writes is parsed,
nothing is constrained), "required" (one call at least, each valid against its function's parameters) or a
named function (a call of that function). `parallel_tool_calls: false` allows one call only.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from deployments import strict
from workers.grammar import StructuredSpec

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"        # OpenAI's rule for schema and function names
NO_PARAMETERS = {"type": "object", "properties": {}}   # OpenAI: no `parameters` is an empty parameter list


class StrictModel(strict.StrictModel):
    model_config = ConfigDict(populate_by_name=True)   # `schema` is spelled `schema_` here (BaseModel has one)


class JSONSchemaFormat(StrictModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None                  # the grammar always enforces the schema


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('response_format: "json_schema" is required exactly when type is "json_schema"')
        return self

    def spec(self) -> StructuredSpec | None:
        if self.type == "json_object":
            return StructuredSpec("json_object", "", "response_format")
        if self.type == "json_schema":
            return StructuredSpec.json_schema(self.json_schema.schema_, "response_format.json_schema.schema")
        return None


class StructuredOutputs(StrictModel):
    """vLLM's structured_outputs: exactly one of json (a schema), json_object, regex, choice, grammar (EBNF)."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None

    def spec(self) -> StructuredSpec:
        given = [k for k in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice, grammar; "
                             f"got {len(given)}")
        kind = given[0]
        field = f"structured_outputs.{kind.rstrip('_')}"
        if kind == "json_":
            schema = self.json_
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{field}: not valid JSON: {exc}") from None
            return StructuredSpec.json_schema(schema, field)
        if kind == "json_object":
            return StructuredSpec("json_object", "", field)
        if kind == "choice":
            return StructuredSpec("choice", json.dumps(self.choice), field)
        return StructuredSpec(kind, getattr(self, kind), field)


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(StrictModel):
    name: str
    arguments: str                              # JSON text, as OpenAI sends it


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction

    def template_dict(self) -> dict:
        """As chat templates read it: arguments as an object where they parse as one (Qwen3's `tojson`)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def constraint(response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None,
               tools: list[Tool] | None = None, tool_choice: str | NamedToolChoice | None = None,
               parallel_tool_calls: bool | None = None) -> StructuredSpec | None:
    """The one constraint a request asks for (None: free text); asking for two is a ValueError (400)."""
    specs = []
    if response_format is not None and response_format.spec() is not None:
        specs.append(("response_format", response_format.spec()))
    if structured_outputs is not None:
        specs.append(("structured_outputs", structured_outputs.spec()))
    calls = tool_call_spec(tools, tool_choice, parallel_tool_calls)
    if calls is not None:
        specs.append(("tool_choice", calls))
    if len(specs) > 1:
        raise ValueError(f"{' and '.join(name for name, _ in specs)} cannot be combined: each constrains the "
                         "whole output")
    return specs[0][1] if specs else None


def tool_call_spec(tools: list[Tool] | None, tool_choice: str | NamedToolChoice | None,
                   parallel_tool_calls: bool | None) -> StructuredSpec | None:
    if not tools:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools: no tools were given")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    if tool_choice in (None, "none", "auto"):
        return None
    chosen = tools
    if isinstance(tool_choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == tool_choice.function.name]
        if not chosen:
            raise ValueError(f"tool_choice names function {tool_choice.function.name!r}, which is not among the "
                             f"tools ({', '.join(names)})")
    named = isinstance(tool_choice, NamedToolChoice)   # a named choice is one call of that function
    return StructuredSpec.tool_calls([(t.function.name, t.function.parameters or NO_PARAMETERS) for t in chosen],
                                     parallel=parallel_tool_calls is not False and not named)
