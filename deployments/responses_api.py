"""OpenAI's Responses API request (POST /v1/responses), served as the chat completion it means.

`ResponsesRequest.chat_request()` translates a request at the edge into a protocol.ChatCompletionRequest:
`instructions` and the `input` items become chat messages (an earlier `function_call` joins the assistant
message before it as one of its tool_calls, a `function_call_output` is a tool message), the function `tools`,
`tool_choice`, `text.format`, `max_output_tokens` and the sampling fields their chat twins; the chat model
then validates it and the replica runs the chat path unchanged (template, grammar, tool-call and reasoning
parsers). Only the output is rendered otherwise (deployments/responses_render.py).

Strict as every route (deployments/strict.py): an unknown field is a 400 naming it. No response is stored:
`store: true` and `previous_response_id` are a 400 saying so (send the conversation as `input`). The
`reasoning` items a client sends back from earlier output are accepted and not shown to the model: chat
messages carry no reasoning either. vLLM's sampling extensions of its Responses API (top_k, seed, stop,
repetition_penalty, logit_bias ...) are accepted as in chat completions.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deployments.protocol import SAMPLING_FIELDS, ChatCompletionRequest, SamplingFields
from deployments.responses_render import ResponsesSpec
from deployments.strict import StrictModel
from deployments.structured import NAME_PATTERN

# labels of the request or of earlier output items sent back: they change nothing in the answer
HARMLESS = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
                      "max_tool_calls"})   # max_tool_calls bounds built-in tools' calls: this server has none
UNSUPPORTED_UNLESS = {"background": (None, False), "include": (None, []), "prompt": (None,), "conversation": (None,),
                      "truncation": (None, "disabled"), "top_logprobs": (None, 0),
                      "stream_options": (None, {"include_obfuscation": False}), "context_management": (None, [])}
NOT_STORED = ("this server keeps no responses (no store, no previous_response_id): send the whole conversation "
              "as input, with store false or absent")
ITEM_LABELS = frozenset({"id", "status", "phase"})   # an earlier output item's own id, status and phase


class ContentPart(StrictModel):
    harmless = frozenset({"annotations", "logprobs"})   # an earlier output_text's citations and logprobs
    type: Literal["input_text", "output_text"]          # text only: images, files, audio are a 400
    text: str


def _parts(value: Any) -> Any:
    """A string is one text part (so a wrong part is refused by its own field, not as a failed union)."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _text(parts: list[ContentPart]) -> str:
    return "".join(part.text for part in parts)


class Message(StrictModel):
    harmless = ITEM_LABELS
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]

    _content_parts = field_validator("content", mode="before")(_parts)

    def add_to(self, messages: list[dict]) -> None:
        messages.append({"role": self.role, "content": _text(self.content)})


class FunctionCall(StrictModel):
    harmless = ITEM_LABELS
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    def add_to(self, messages: list[dict]) -> None:
        """One of the tool_calls of the assistant message before it (a response's text, then its calls)."""
        call = {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


class FunctionCallOutput(StrictModel):
    harmless = ITEM_LABELS
    type: Literal["function_call_output"]
    call_id: str
    output: list[ContentPart]

    _output_parts = field_validator("output", mode="before")(_parts)

    def add_to(self, messages: list[dict]) -> None:
        messages.append({"role": "tool", "tool_call_id": self.call_id, "content": _text(self.output)})


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    harmless = ITEM_LABELS
    unsupported = {"encrypted_content": (None,)}
    type: Literal["reasoning"]
    summary: list[ReasoningText]
    content: list[ReasoningText] | None = None

    def add_to(self, messages: list[dict]) -> None:
        """Not shown to the model (see the module's docstring)."""


ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput",
             "reasoning": "Reasoning"}   # capitalised: error locations drop them (deployments/errors.py)


def _item_tag(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return ITEM_TAGS.get(kind) if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[Message, Tag("Message")] | Annotated[FunctionCall, Tag("FunctionCall")]
    | Annotated[FunctionCallOutput, Tag("FunctionCallOutput")] | Annotated[ReasoningItem, Tag("Reasoning")],
    Discriminator(_item_tag, custom_error_type="invalid_input_item",
                  custom_error_message=f"an input item's type is one of {', '.join(ITEM_TAGS)}")]


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    """text.format: OpenAI's response_format, flattened (a json_schema's name and schema beside its type)."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.name is not None and self.schema_ is not None):
            raise ValueError('name and schema are required exactly when type is "json_schema"')
        return self

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


class TextConfig(StrictModel):
    unsupported = {"verbosity": (None,)}
    format: TextFormat | None = None


class Reasoning(StrictModel):
    unsupported = {"summary": (None,), "generate_summary": (None,)}   # the reasoning itself is returned, no summary
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None   # to the chat template


class ResponsesRequest(SamplingFields):
    harmless = HARMLESS
    unsupported = UNSUPPORTED_UNLESS
    model: str
    input: list[InputItem] = Field(min_length=1)   # a string is one user message
    instructions: str | None = None                # a system message before the input
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None               # null: the default, as OpenAI's
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = None         # echoed in the response
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    logit_bias: dict[str, float] | None = None     # vLLM's Responses extension, as in chat completions

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, value: Any) -> Any:
        return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _nothing_stored(self):
        for field, value in (("store", self.store), ("previous_response_id", self.previous_response_id)):
            if value not in (None, False):
                raise PydanticCustomError("unsupported_parameter", "{field}: {reason}",
                                          {"field": field, "reason": NOT_STORED})
        return self

    def chat_messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        for item in self.input:
            item.add_to(messages)
        return messages

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request asks for (validated by the chat route's own model)."""
        sampling = {name: value for name, value in self.model_dump(include=set(SAMPLING_FIELDS),
                                                                     exclude_unset=True).items() if value is not None}
        # A forced call (required or named) leaves no message for text.format to shape: only the call is constrained
        # (the Agents SDK sends its output_type's format with the tool_choice of every turn).
        forced = bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, FunctionChoice))
        text_format = self.text.format if self.text and self.text.format and not forced else None
        fields = dict(model=self.model, messages=self.chat_messages(), tool_choice=self._chat_tool_choice(),
                      parallel_tool_calls=self.parallel_tool_calls, max_completion_tokens=self.max_output_tokens,
                      logit_bias=self.logit_bias, tools=[t.chat_tool() for t in self.tools] if self.tools else None,
                      reasoning_effort=self.reasoning.effort if self.reasoning else None,
                      response_format=text_format.response_format() if text_format else None)
        return ChatCompletionRequest.model_validate({**sampling, **fields})

    def _chat_tool_choice(self) -> str | dict | None:
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def render_spec(self, chat: ChatCompletionRequest) -> ResponsesSpec:
        """What the response repeats of the request: its settings as they apply (defaults filled in)."""
        text_format = self.text.format if self.text and self.text.format else None
        echoed = {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": self.reasoning.effort if self.reasoning else None,
                                                        "summary": None},
            "store": False, "temperature": chat.temperature, "top_p": chat.top_p,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format
                     else {"type": "text"}},
            "tool_choice": (self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice)
                            else self.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or []], "truncation": "disabled",
            "background": False}
        return ResponsesSpec(model=self.model, tool_calls=chat.parses_tool_calls, echoed=echoed)
