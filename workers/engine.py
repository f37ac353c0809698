"""LLMEngine: the synchronous Python API, a front over the engine core (workers/core.py).

The core steps token ids; this front tokenizes prompts, validates each request once (workers/request.py),
detokenizes incrementally and applies stop strings (workers/output.py) for the requests added here, as the
asynchronous front (workers/async_engine.py) does for a replica. `step_deltas` (the core's step) stays
available: its deltas carry no text.
"""
from __future__ import annotations

import time
from typing import Sequence as Seq

from workers.config import EngineConfig, SamplingParams
from workers.core import EngineCore
from workers.output import RequestState
from workers.request import EngineRequest, build_request, check_prompt_chars
from workers.sequence import RequestOutput
from workers.tokenizer import encode, max_prompt_chars

Prompt = str | list[int]


class LLMEngine(EngineCore):
    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.max_prompt_chars = max_prompt_chars(self.tokenizer, self.runtime.max_model_len)
        self._states: dict[str, RequestState] = {}   # requests added with detokenize=True

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None,
                     request_id: str | None = None) -> EngineRequest:
        """The synchronous API's edge: the prompt tokenized, the request validated (workers/request.py)."""
        max_len = self.runtime.max_model_len
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), self.max_prompt_chars, max_len)
            token_ids = encode(self.tokenizer, prompt)
        else:
            token_ids = list(prompt or [])
        return build_request(prompt, token_ids, params or SamplingParams(), adapter, request_id, max_len,
                             self.runtime.hf_config.vocab_size)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None,
                    request_id: str | None = None, *, detokenize: bool = True, grammar=None) -> str:
        """Queue a request. detokenize=False: its text is made by the caller, from `step_deltas`; `step` then
        reports nothing for it. `grammar`: params.structured compiled already (`self.grammars.compile`), else
        it is compiled now."""
        request_id = self.add(self.make_request(prompt, params, adapter, request_id), grammar)
        if detokenize:
            self._detokenize(request_id)
        return request_id

    def _detokenize(self, request_id: str) -> None:
        seq = self._seqs[request_id]
        self._states[request_id] = RequestState(request_id, seq.prompt_token_ids, seq.params, self.tokenizer,
                                                seq.adapter)

    def abort(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        super().abort(request_id)


    def step(self) -> list[RequestOutput]:
        """Run one step; cumulative outputs (with text) of every request added with detokenize=True that
        progressed or ended."""
        outputs = []
        for delta in self.step_deltas():
            state = self._states.get(delta.request_id)
            if state is None:
                continue
            if state.update(delta):   # a stop string: the request ends here
                seq = self._seqs.pop(delta.request_id, None)
                if seq is not None:
                    self.controller.finish(seq, "stop")
            outputs.append(state.output())
            if state.finished:
                del self._states[delta.request_id]
        return outputs

    def generate(self, prompts: Seq[Prompt] | Prompt, params: SamplingParams | Seq[SamplingParams] | None = None,
                 adapters: Seq[str | None] | None = None) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else prompts
        params = params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        adapters = list(adapters) if adapters is not None else [None] * len(prompts)
        if not len(prompts) == len(params) == len(adapters):
            raise ValueError(f"got {len(prompts)} prompts, {len(params)} sampling params, {len(adapters)} adapters")
        seqs = [self._sequence(self.make_request(p, sp, a)) for p, sp, a in zip(prompts, params, adapters)]
        ids = [self._queue(seq) for seq in seqs]   # all validated before any is queued
        for request_id in ids:
            self._detokenize(request_id)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            outputs = self.step()
            done.update((out.request_id, out) for out in outputs if out.finished)
            if not outputs:
                time.sleep(0.001)   # waiting on a background adapter load
        return [done[rid] for rid in ids]
