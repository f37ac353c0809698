"""EngineRequest: one request as the engine core takes it, built and validated once at the edge.

The edges are the callers' side of an engine: a replica (HTTP ingress or a handle call, through
AsyncLLMEngine.make_request) and the synchronous Python API (LLMEngine.make_request). Each tokenizes the
prompt (a text far too long for max_model_len refused before: check_prompt_chars) and calls
`build_request`, which runs the other request rules of workers/limits.py once; the core (LLMEngine.add)
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
from workers.limits import check_fits, check_prompt, check_token_ids, room_to_generate


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
