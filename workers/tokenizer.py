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
import importlib
from pathlib import Path

from workers.limits import check_prompt_chars

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


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
    """The chat template's prompt as token ids (the template writes its own special tokens, so by default none
    are added again, as transformers' own apply_chat_template(tokenize=True) does)."""
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # jinja errors: the messages do not fit the model's template
        raise ValueError(f"chat template failed for these messages: {exc}") from exc
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


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
                          add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        size = sum(len(m.get("content") or "") for m in messages)
        check_prompt_chars(size, self.max_chars, self.max_model_len)
        return await self._run(render_chat, messages, add_generation_prompt, add_special_tokens, tools)

    async def _run(self, fn, *args):
        return await asyncio.wrap_future(self._executor.submit(fn, self._tokenizer, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
