"""The OpenAI wire format: request bodies (validated) and response / stream-chunk bodies.

Fields OpenAI has but this server does not implement are accepted only at
their defaults, so a request is never silently served differently from what
it asked for (`n=2` is a 400, not one choice).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.sequence import RequestOutput

# field -> the values that mean "off" (anything else asks for something this server does not do)
UNSUPPORTED_UNLESS = {"n": (1,), "best_of": (None, 1), "echo": (False,), "suffix": (None, ""),
                      "logit_bias": (None, {}), "presence_penalty": (0.0,), "frequency_penalty": (0.0,),
                      "tools": (None, []), "response_format": (None, {"type": "text"})}


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)   # JSON's NaN / Infinity are not sampling values

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)   # vLLM extension
    ignore_eos: bool = False             # vLLM extension
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self):
        for field, allowed in UNSUPPORTED_UNLESS.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field}={getattr(self, field)!r} is not supported (only {allowed[0]!r})")
        return self

    def sampling_params(self, default_max_tokens: int | None) -> dict[str, Any]:
        """Keyword arguments of workers.SamplingParams; max_tokens None = the rest of the context."""
        return dict(max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                    stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=1)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt is empty")
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = [p for p in self.content if p.get("type") != "text"]
            if parts:
                raise ValueError(f"message content parts of type {parts[0].get('type')!r} are not supported")
            return "".join(p.get("text", "") for p in self.content)
        return self.content or ""


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def sampling_params(self, default_max_tokens: int | None) -> dict[str, Any]:
        params = super().sampling_params(default_max_tokens)
        if self.max_completion_tokens is not None:
            params["max_tokens"] = self.max_completion_tokens
        return params


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


# ---- responses ---------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(output: RequestOutput) -> str | None:
    """OpenAI knows stop / length; an aborted request stopped."""
    return None if output.finish_reason is None else ("length" if output.finish_reason == "length" else "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# Tokens are named by id ("token_id:42", as vLLM's return_tokens_as_token_ids): exact, and the
# ingress needs no tokenizer.
def completion_logprobs(output: RequestOutput) -> dict[str, Any]:
    return {"tokens": [f"token_id:{t}" for t in output.token_ids], "token_logprobs": list(output.logprobs),
            "top_logprobs": None, "text_offset": None}


def chat_logprobs(output: RequestOutput) -> dict[str, Any]:
    return {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(output.token_ids, output.logprobs)]}


def completion_body(request_id: str, model: str, choices: list[dict], usage_: dict | None,
                    chunk: bool = False) -> dict[str, Any]:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def chat_body(request_id: str, model: str, choices: list[dict], usage_: dict | None,
              chunk: bool = False) -> dict[str, Any]:
    body = {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": logprobs}


def chat_chunk_choice(index: int, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
