"""The request rules, each written once and run once per request where the request is built
(workers/request.py): a prompt is present, fits `max_model_len` with its `max_tokens`, and names
only ids of the vocabulary. Sampling parameters' own ranges are SamplingParams' (workers/config.py),
adapter names lora.names'."""
from __future__ import annotations


def check_prompt(prompt, token_ids: list[int]) -> None:
    """A prompt (text or token ids) with something in it, also once tokenized (a text of nothing but what
    the tokenizer drops)."""
    if prompt is None or (isinstance(prompt, (str, list, tuple)) and not prompt) or not token_ids:
        raise ValueError("prompt is empty")


def check_prompt_chars(num_chars: int, limit: int, max_model_len: int) -> None:
    """`limit`: workers.tokenizer.max_prompt_chars, above which no tokenization fits max_model_len."""
    if num_chars > limit:
        raise ValueError(f"the prompt ({num_chars} characters) is far longer than max_model_len "
                         f"({max_model_len} tokens) allows")


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens + max_tokens > max_model_len:
        raise ValueError(f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                         f"max_model_len ({max_model_len})")


def room_to_generate(num_prompt_tokens: int, max_model_len: int) -> int:
    """The default max_tokens: the rest of the context (at least one token)."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ValueError(f"the prompt ({num_prompt_tokens} tokens) fills max_model_len ({max_model_len}); "
                         "no room to generate")
    return room
