"""The bodies of the routes beside generation: vLLM's /tokenize and /detokenize, and the adapter RPC
(/v1/load_lora_adapter, /v1/unload_lora_adapter). Strict as deployments/protocol.py's: any other field is a 400."""
from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from deployments.protocol import ChatMessage
from deployments.strict import StrictModel

MAX_LORA_NAME_CHARS = 1024   # names are checked again (at most 128 characters) where the adapter is loaded
MAX_LORA_PATH_CHARS = 4096   # PATH_MAX


def _bounded_string(field: str, limit: int):
    """An over-long value: a 400 naming the field and the limit (its length, not only pydantic's "too long")."""
    def check(value: str) -> str:
        if len(value) > limit:
            raise PydanticCustomError("value_too_long", "{length} characters, over the limit of {limit}",
                                      {"length": len(value), "limit": limit})
        return value

    return field_validator(field)(check)


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    replace: bool = False                # a hot-loaded name gets a new source only when asked

    _name_length = _bounded_string("lora_name", MAX_LORA_NAME_CHARS)
    _path_length = _bounded_string("lora_path", MAX_LORA_PATH_CHARS)


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str = Field(min_length=1)

    _name_length = _bounded_string("lora_name", MAX_LORA_NAME_CHARS)


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a prompt, or chat messages through the model's chat template."""
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None       # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str
    tokens: list[int] = Field(max_length=1 << 20)
