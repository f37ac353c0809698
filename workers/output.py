"""Turning the engine's token deltas into what a caller sees: incremental text and stop strings.

This runs in front of the engine (the replica's event loop, or the sync engine
after its step), never inside the model step: each new token costs the same
whether it is the 1st or the 4,000th of its request. Text is decoded
incrementally (the tokenizers library's DecodeStream, which holds back a
partial UTF-8 character until it is complete) instead of decoding the whole
output again every step, and stop strings are searched for in the new text
only (plus the few characters before it that a stop string could start in).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from workers.config import SamplingParams
from workers.sequence import RequestOutput, TokenDelta


class IncrementalDetokenizer:
    """`add(token_ids)` returns the text those tokens add; concatenated, it equals decoding them all at once.

    Tokenizers without a Rust backend (transformers' Python ones) take the generic path: decode a window
    from the last stable point and emit what grew, as vLLM's detokenize_incrementally does.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, generic: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        backend = None if generic else getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if backend is not None else None
        self._ids: list[int] = []
        self._num_chars = 0            # characters emitted so far
        self._emitted = 0              # tokens whose text is all emitted
        self._prefix_offset = self._read_offset = 0   # the generic path's window

    def add(self, token_ids: list[int]) -> str:
        pieces = []
        for t in token_ids:
            self._ids.append(t)
            piece = self._stream.step(self._backend, t) if self._stream is not None else self._step_generic()
            if piece:
                pieces.append(piece)
                self._num_chars += len(piece)
                self._emitted = len(self._ids)
        return "".join(pieces)

    def flush(self) -> str:
        """At the end: the text of tokens still held back (an incomplete character decodes as U+FFFD, as
        decoding everything at once would)."""
        if self._emitted == len(self._ids):
            return ""
        text = self._decode(self._ids)
        tail, self._num_chars, self._emitted = text[self._num_chars:], len(text), len(self._ids)
        return tail

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step_generic(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""   # nothing new yet, or a character still incomplete
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix):]


class RequestState:
    """One request as its caller sees it: tokens, logprobs, text so far, and how it ended."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tokenizer,
                 adapter: str | None = None):
        self.request_id, self.prompt_token_ids, self.adapter = request_id, prompt_token_ids, adapter
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = params.stop
        self.min_tokens = params.min_tokens     # stop strings count only from then on, as in vLLM
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list | None = [] if params.top_logprobs else None
        self.prompt_logprobs: list | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0
        self.queue_time: float | None = None
        self._sent_tokens = self._sent_text = 0
        self._sent_prompt = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, delta: TokenDelta) -> bool:
        """Apply one engine delta. True when a stop string ended the request here: the caller must abort it
        in the engine (which may still produce a token or two; they are dropped)."""
        if self.finished:
            return False
        self.num_cached_tokens = delta.num_cached_tokens
        self.queue_time = delta.queue_time
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        for i, token in enumerate(delta.new_token_ids):   # one at a time: a stop string ends at its token
            self.token_ids.append(token)
            self.logprobs.append(delta.new_logprobs[i])
            if self.top_logprobs is not None:
                self.top_logprobs.append(delta.new_top_logprobs[i])
            before = len(self.text)
            self.text += self.detokenizer.add([token])
            if self.stops and len(self.token_ids) >= self.min_tokens and self._cut_at_stop(before):
                self.finish_reason = "stop"
                return True
        if delta.finished:
            before = len(self.text)
            self.text += self.detokenizer.flush()
            if self.stops and len(self.token_ids) >= self.min_tokens and self._cut_at_stop(before):
                self.finish_reason = "stop"
                return False          # the engine has ended it already
            self.finish_reason, self.error = delta.finish_reason, delta.error
        return False

    def _cut_at_stop(self, before: int) -> bool:
        start = max(0, before - self.max_stop + 1)   # a stop string may begin in the old text
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
        return bool(hits)

    def output(self, delta: bool = False) -> RequestOutput:
        """Everything so far, or (delta) what is new since the last delta. A delta holds back text that may
        still turn out to be the start of a stop string."""
        top = self.top_logprobs
        if not delta:
            return RequestOutput(self.request_id, list(self.prompt_token_ids), list(self.token_ids), self.text,
                                 list(self.logprobs), self.finish_reason, self.adapter, self.error,
                                 self.num_cached_tokens, None if top is None else list(top), self.prompt_logprobs,
                                 self.queue_time)
        end = len(self.text) if self.finished else max(self._sent_text, len(self.text) - max(self.max_stop - 1, 0))
        first, new = not self._sent_prompt, slice(self._sent_tokens, None)
        out = RequestOutput(self.request_id, self.prompt_token_ids if first else [], self.token_ids[new],
                            self.text[self._sent_text:end], self.logprobs[new], self.finish_reason, self.adapter,
                            self.error, self.num_cached_tokens, None if top is None else top[new],
                            self.prompt_logprobs if first else None, self.queue_time)
        self._sent_prompt, self._sent_tokens, self._sent_text = True, len(self.token_ids), end
        return out


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet (tokenizers' ByteLevel): printable bytes stand for themselves, the rest
    are shifted past 255; inverted, it gives every byte-level token its exact bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()


class TokenNames:
    """A token id's text and exact UTF-8 bytes (OpenAI's logprobs `token` and `bytes`), cached per id.

    Byte-level BPE tokens map to their bytes exactly (a token may hold part of a character: its text then
    shows U+FFFD, its bytes stay exact); other tokenizers take what decoding the one token gives.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        named = self._cache.get(token_id)
        if named is None:
            named = self._cache[token_id] = self._name(token_id)
        return named

    def _name(self, token_id: int) -> tuple[str, list[int]]:
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if self.byte_level and token is not None and all(c in _BYTE_LEVEL for c in token):
            raw = bytes(_BYTE_LEVEL[c] for c in token)
        else:
            raw = self.tokenizer.decode([token_id]).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)
