"""Tokenization in front of the engine: its own tokenizer, its own thread, a cheap length check first.

The engine's step thread only schedules and runs the model, and the replica's
event loop must keep streaming everyone's tokens, so prompts are tokenized and
chat templates rendered on one dedicated thread with a tokenizer instance of
its own (a Rust tokenizer must not be borrowed mutably by two threads at
once). A text too long to fit `max_model_len` tokens under any tokenization is
refused before it is tokenized at all.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
from pathlib import Path
from typing import Any

from workers.request import check_prompt_chars

# Normalizers may compose characters (NFC / NFKC: a base letter and its combining marks become one),
# so a text can shrink before it is split into tokens; 4x covers composition with room to spare.
NORMALIZATION_SLACK = 4


def load_tokenizer(path: str | Path, tokenizer_class: str | None = None):
    """The tokenizer AutoTokenizer gives for `path`. With `tokenizer_class` (`tokenizer_class_of` the one the engine
    loaded), that class's own from_pretrained, which is what AutoTokenizer ends in, without its model-config
    machinery: that imports torch, which a replica whose engine runs in a process of its own never needs."""
    if tokenizer_class and tokenizer_class.startswith("transformers."):
        module, name = tokenizer_class.split(":")
        return getattr(importlib.import_module(module), name).from_pretrained(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def tokenizer_class_of(tokenizer) -> str:
    """`module:name` of the tokenizer's class, for `load_tokenizer` in another process."""
    return f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}"


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Characters above which a text has more than `max_model_len` tokens whatever it says: no token of
    the vocabulary decodes to more characters than its own string has."""
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 1) * NORMALIZATION_SLACK


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    # The tokenizer's __call__ runs the Rust batch encoder, which releases the GIL while it works (the
    # backend's single-text encode holds it: a 4 MiB prompt would stop every other Python thread ~2.5 s).
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


# apply_chat_template's own parameters (how to tokenize, which template, what to return) and the names the
# renderer itself gives the template: a caller's chat_template_kwargs may set none of them
NOT_TEMPLATE_VARIABLES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "raise_exception", "strftime_now"})
RENDER_OPTIONS = frozenset({"add_generation_prompt", "continue_final_message"})   # apply_chat_template's, and
                                                                                  # the template's variables


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                add_special_tokens: bool = False, tools: list[dict] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The chat template's prompt as token ids (the template writes its own special tokens, so by default none
    are added again, as transformers' own apply_chat_template(tokenize=True) does).

    `chat_template_kwargs` (vLLM's): values for the template's own variables (Qwen3's `enable_thinking`), and
    `add_generation_prompt` / `continue_final_message`; a name the template does not read is dropped, as vLLM
    drops it (it could change nothing). The values are plain JSON data in transformers' sandboxed Jinja."""
    options = template_options(tokenizer, tools, {"add_generation_prompt": add_generation_prompt,
                                                  **(chat_template_kwargs or {})})
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **options)
    except Exception as exc:  # jinja errors: the messages do not fit the model's template
        raise ValueError(f"chat template failed for these messages: {exc}") from exc
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def template_options(tokenizer, tools: list[dict] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The kwargs apply_chat_template gets: render options, and the variables this template reads."""
    refused = sorted(NOT_TEMPLATE_VARIABLES & kwargs.keys())
    if refused:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(refused)}: only the chat template's own "
                         "variables (and add_generation_prompt, continue_final_message)")
    try:
        template = tokenizer.get_chat_template(tools=tools)
    except ValueError as exc:   # no chat template at all
        raise ValueError(f"this model has no chat template: {exc}") from exc
    read = template_variables(template)
    return {name: value for name, value in kwargs.items() if name in read or name in RENDER_OPTIONS}


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The names a chat template reads from its context (in transformers' own Jinja environment)."""
    from jinja2 import meta
    from transformers.utils.chat_template_utils import _compile_jinja_template
    environment = _compile_jinja_template(template).environment
    return frozenset(meta.find_undeclared_variables(environment.parse(template)))


class PromptEncoder:
    """Tokenization for one engine's callers, on its own thread; awaitable from any event loop."""

    def __init__(self, model_path: str | Path, max_model_len: int, tokenizer_class: str | None = None):
        self.max_model_len = max_model_len
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tokenizer = self._executor.submit(load_tokenizer, model_path, tokenizer_class).result()
        self.max_chars = max_prompt_chars(self._tokenizer, max_model_len)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_prompt_chars(len(text), self.max_chars, self.max_model_len)
        return await self._run(encode, text, add_special_tokens)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict] | None = None,
                          chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        size = sum(len(m.get("content") or "") for m in messages)
        check_prompt_chars(size, self.max_chars, self.max_model_len)
        return await self._run(render_chat, messages, add_generation_prompt, add_special_tokens, tools,
                               chat_template_kwargs)

    async def _run(self, fn, *args):
        return await asyncio.wrap_future(self._executor.submit(fn, self._tokenizer, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
