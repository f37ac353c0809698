"""The OpenAI wire format of requests: bodies validated here (responses are built in deployments/responses.py).

Strict and honest (deployments/strict.py): a field is either implemented, harmless (`HARMLESS`: accepted
and ignored, it changes nothing in the answer), or accepted only at the value that means "off"
(`UNSUPPORTED_UNLESS`), so a request is never silently served differently from what it asked for
(`suffix: "x"` is a 400, not a completion without it). Any other field is a 400 naming it.
Types are strict: `"4"` is not 4 and `true` is not a token id.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_type_hints

from pydantic import ConfigDict, Field, create_model, model_validator

from deployments.structured import (MessageToolCall, NamedToolChoice, ResponseFormat, StructuredOutputs, Tool,
                                    constraint)
from deployments.choices import MAX_CHOICES, check_choices, ranks
from deployments.strict import StrictModel, shown
from deployments.tool_calls import END as TOOL_CALL_END
from workers.config import MAX_LOGPROBS, SamplingParams

# accepted and ignored: they label or route a request on OpenAI's side and change nothing in the answer
HARMLESS = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key", "service_tier",
                      "parallel_tool_calls"})
# field -> the values that mean "off" (anything else asks for something this server does not do)
UNSUPPORTED_UNLESS = {
    "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "store": (None, False),
    "top_logprobs": (None, 0),           # completions: its logprobs=N says it (chat has the field itself)
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "verbosity": (None,), "web_search_options": (None,),
    # vLLM extensions (vllm/entrypoints/openai/protocol.py's sampling and extra params), at their defaults
    "length_penalty": (None, 1),
    "use_beam_search": (None, False), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "include_stop_str_in_output": (None, False), "allowed_token_ids": (None,), "bad_words": (None, []),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False), "chat_template": (None,),
    "chat_template_kwargs": (None, {}), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "guided_decoding_backend": (None,), "guided_whitespace_pattern": (None,),
    "structural_tag": (None,), "priority": (None, 0), "request_id": (None,), "documents": (None,),
    "mm_processor_kwargs": (None,), "logits_processors": (None,), "cache_salt": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "prompt_embeds": (None,), "return_token_ids": (None, False),
    "include_reasoning": (None, True),   # completions have no reasoning to leave out (chat: a field)
}
MAX_PROMPTS = 256                          # prompts of one /v1/completions request (each is a handle call)
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)   # what torch.Generator.manual_seed takes


class StreamOptions(StrictModel):
    include_usage: bool | None = None       # a last chunk with the usage (OpenAI's; absent: none)
    continuous_usage_stats: bool = False    # vLLM's: the usage so far on every chunk (unless include_usage: false)


# SamplingParams fields the wire spells otherwise (or not at all); every other one is a request field of the same
# name, type and default, declared once, in workers/config.py (its ranges are checked there: a ValueError, a 400)
ENGINE_SPELLED = frozenset({"max_tokens", "logit_bias", "logprobs", "top_logprobs", "prompt_logprobs", "structured"})
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in ENGINE_SPELLED)


def _wire_field(f: dataclasses.Field) -> tuple[Any, Any]:
    default = Field(default_factory=f.default_factory) if f.default is dataclasses.MISSING else f.default
    return get_type_hints(SamplingParams)[f.name], default


SamplingFields = create_model("SamplingFields", __base__=StrictModel, **{
    f.name: _wire_field(f) for f in dataclasses.fields(SamplingParams) if f.name in SAMPLING_FIELDS})


class OpenAIRequest(SamplingFields):
    harmless = HARMLESS
    unsupported = UNSUPPORTED_UNLESS
    model: str
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)  # choices; they share the prompt's KV blocks (prefix cache)
    return_tokens_as_token_ids: bool = False   # vLLM extension: logprobs name tokens "token_id:<id>"
    logit_bias: dict[str, float] | None = None   # OpenAI's: token id (as a JSON key) -> bias
    response_format: ResponseFormat | None = None              # deployments/structured.py
    structured_outputs: StructuredOutputs | None = None        # vLLM extension

    @model_validator(mode="after")
    def _check_choices(self):
        """n and best_of: checked here for the HTTP edge (a handle call's in LLMServer)."""
        check_choices(self.n, getattr(self, "best_of", None), self.stream)   # (the bounds are the fields' too)
        return self

    def constraint(self):
        return constraint(self.response_format, self.structured_outputs)

    def to_sampling_params(self, default_max_tokens: int | None = None) -> SamplingParams:
        """The body's sampling parameters in the one form they keep from here to the engine's sequence (built,
        so checked, once: workers/config.py). max_tokens None: the rest of the context, resolved where the
        prompt's length is known (workers/request.py). Logprobs are computed only where the answer shows them or
        best_of ranks by them (a logsumexp over the vocabulary a step otherwise)."""
        return SamplingParams(**{name: getattr(self, name) for name in SAMPLING_FIELDS if name != "stop"},
                              stop=self._stop(), structured=self.constraint(), logit_bias=self._token_bias(),
                              logprobs=self.wants_logprobs or ranks(self.n, getattr(self, "best_of", None)),
                              max_tokens=self._max_tokens(default_max_tokens), top_logprobs=self.num_top_logprobs,
                              prompt_logprobs=self._prompt_logprobs())

    def _max_tokens(self, default: int | None) -> int | None:
        return self.max_tokens if self.max_tokens is not None else default

    def _stop(self) -> list[str] | str | None:
        return self.stop

    def _prompt_logprobs(self) -> int | None:
        return None

    @property
    def num_top_logprobs(self) -> int:
        return 0

    def _token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bad = next((key for key in self.logit_bias if not key.isdigit()), None)
        if bad is not None:
            raise ValueError(f"logit_bias keys must be token ids (digits), got {shown(bad)}")
        return {int(key): value for key, value in self.logit_bias.items()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats, under its include_usage (whose default is true in vLLM)."""
        options = self.stream_options
        return bool(options and options.continuous_usage_stats and options.include_usage is not False)


class CompletionRequest(OpenAIRequest):
    unsupported = UNSUPPORTED_UNLESS | {"add_special_tokens": (None, True)}
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)   # 0 with echo: the prompt scored, nothing generated (vLLM's)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # the sampled token's, and this many alternatives
    echo: bool = False                   # the prompt before the completion (with its logprobs if asked)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)     # sample this many, return the n likeliest

    @model_validator(mode="after")
    def _scoring_needs_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is only for scoring a prompt, with echo: true")
        return self

    @property
    def score_prompt(self) -> bool:
        """max_tokens 0 with echo: the prompt (and its logprobs), no completion."""
        return self.echo and self.max_tokens == 0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    def _prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def _max_tokens(self, default: int | None) -> int | None:
        if self.score_prompt:   # the prompt's logprobs come with a step; its one token is not shown (as vLLM)
            return 1
        return super()._max_tokens(default)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:   # no prompt at all (each prompt's own rule is workers.request.check_prompt, once)
            raise ValueError("prompt is empty")
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request")
        return list(prompt)


class ContentPart(StrictModel):
    model_config = ConfigDict(extra="allow")   # other part types carry their own fields; refused in text()
    type: str
    text: str = ""


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None              # harmless: chat templates of this model family ignore it
    tool_calls: list[MessageToolCall] | None = None   # an assistant's earlier calls
    tool_call_id: str | None = None                   # a tool message: the call it answers

    @model_validator(mode="after")
    def _tool_fields_by_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls is only allowed on assistant messages, not {self.role!r}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id is only allowed on tool messages, not {self.role!r}")
        return self

    def template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p for p in self.content if p.type != "text"]
            if parts:
                raise ValueError(f"message content parts of type {shown(parts[0].type)} are not supported")
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAIRequest):
    harmless = HARMLESS - {"parallel_tool_calls"}
    unsupported = UNSUPPORTED_UNLESS | {"add_special_tokens": (None, False), "echo": (None, False)}
    messages: list[ChatMessage] = Field(min_length=1)
    # the chat template's (vLLM's semantics, workers/tokenizer.render_chat): values for its variables
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False     # the last (assistant) message is continued, not closed
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # a template's
    include_reasoning: bool = True           # vLLM's: false leaves a reasoning parser's reasoning out of the answer
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def constraint(self):
        return constraint(self.response_format, self.structured_outputs, self.tools, self.tool_choice,
                          self.parallel_tool_calls)

    @property
    def parses_tool_calls(self) -> bool:
        """The model sees the tools and its calls are parsed into message.tool_calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template takes them (none when tool_choice is "none": the model never sees them)."""
        if not self.parses_tool_calls:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def num_top_logprobs(self) -> int:
        return self.top_logprobs or 0

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    @model_validator(mode="after")
    def _one_way_to_end(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message: true needs add_generation_prompt: false")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is rendered with, as vLLM builds it: the caller's chat_template_kwargs, with
        the request's own fields over them (reasoning_effort only when given: a template may read it)."""
        fields = {"add_generation_prompt": self.add_generation_prompt,
                  "continue_final_message": self.continue_final_message}
        if self.reasoning_effort is not None:
            fields["reasoning_effort"] = self.reasoning_effort
        return {**(self.chat_template_kwargs or {}), **fields}

    def _max_tokens(self, default: int | None) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else super()._max_tokens(default)

    def _stop(self) -> list[str] | str | None:
        if self.parses_tool_calls and self.tool_choice in (None, "auto") and self.parallel_tool_calls is False:
            # auto, one call at most: generation ends with the first call (the parser takes it unterminated)
            stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
            return stops + [TOOL_CALL_END]
        return self.stop
