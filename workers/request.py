"""EngineRequest: one request as the engine core takes it, built and validated once at the edge.

The edges are the callers' side of an engine: a replica (HTTP ingress or a handle call, through
AsyncLLMEngine.make_request) and the synchronous Python API (LLMEngine.make_request). Each tokenizes the
prompt (a text far too long for max_model_len refused before: check_prompt_chars) and calls
`build_request`, which runs the other request rules once. The rules, each written once, below: a prompt is
present, fits `max_model_len` with its `max_tokens`, and names only ids of the vocabulary (sampling parameters'
own ranges are SamplingParams', adapter names lora.names'); the core (LLMEngine.add)
trusts what it receives and checks only its own state (the adapter registered there, the id free).
Sampling parameters are one `SamplingParams` from the edge on (built from the request body, or once from a
handle call's dict); they validate themselves when built (workers/config.py), and their max_tokens None (the
rest of the context) is resolved here, where the prompt's length is known. n / best_of are checked with the
request body or the handle call (deployments/choices.py), whose choices share the one request and its checks.
The callers' side of an engine process loads this module: no torch here.
"""
from __future__ import annotations

from dataclasses import dataclass

from workers.config import SamplingParams


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


@dataclass
class EngineRequest:
    request_id: str | None   # None: the engine names it
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: str | None = None


def build_request(prompt, prompt_token_ids: list[int], params: SamplingParams, adapter: str | None,
                  request_id: str | None, max_model_len: int, vocab_size: int) -> EngineRequest:
    """`prompt` as given (text or ids), `prompt_token_ids` what it tokenized to."""
    check_prompt(prompt, prompt_token_ids)
    check_token_ids(prompt_token_ids, vocab_size, "prompt token ids")
    check_token_ids(params.logit_bias or {}, vocab_size, "logit_bias token ids")
    if params.max_tokens is None:   # the rest of the context
        params = params.resolved(room_to_generate(len(prompt_token_ids), max_model_len))
    check_fits(len(prompt_token_ids), params.max_tokens, max_model_len)
    return EngineRequest(request_id, list(prompt_token_ids), params, adapter)
