"""Thinking models: where the reasoning ends, in token ids, and a grammar that waits for it (vLLM's
`--reasoning-parser`).

A thinking model writes its reasoning between `<think>` and `</think>`, then the answer. A request's
constraint (response_format, tool_choice, structured_outputs) is about the answer, so, as vLLM's
structured-output manager does, the grammar is neither consulted nor advanced until the model has
generated the reasoning-end token; it starts from its first state with the token after it. A prompt whose
last think token is `</think>` has no reasoning left to write (Qwen3's `enable_thinking: false` closes an
empty think block in the prompt): the grammar applies from the first token. The text of the reasoning is
split from the answer where responses are rendered (deployments/reasoning.py).
"""
from __future__ import annotations

from dataclasses import dataclass

# parser name -> (start, end) tags, each one token of the model's tokenizer (vLLM's names)
REASONING_PARSERS = {"qwen3": ("<think>", "</think>")}


@dataclass(frozen=True)
class ThinkTokens:
    start: str
    end: str
    start_id: int
    end_id: int

    def reasoning_ended(self, token_ids) -> bool:
        """vLLM's is_reasoning_end: the last think tag in `token_ids` is the end tag."""
        for token in reversed(token_ids):
            if token == self.end_id:
                return True
            if token == self.start_id:
                return False
        return False


def think_tokens(parser: str | None, tokenizer) -> ThinkTokens | None:
    """The tags of `parser` in `tokenizer` (None without a parser); a tokenizer without them is refused."""
    if parser is None:
        return None
    start, end = REASONING_PARSERS[parser]
    vocab = tokenizer.get_vocab()
    if start not in vocab or end not in vocab:
        raise ValueError(f"reasoning_parser {parser!r} needs {start} and {end} as tokens of the model's tokenizer; "
                         "this one has not got them (not a thinking model?)")
    return ThinkTokens(start, end, vocab[start], vocab[end])


class ReasoningGate:
    """A sequence's grammar matcher (workers/grammar.GrammarMatcher's interface) that waits for the end of the
    reasoning: until then every token is allowed and none reaches the matcher; the end token itself neither."""

    def __init__(self, matcher, end_id: int, ended: bool):
        self._matcher, self._end_id, self.ended = matcher, end_id, ended

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.ended:
            self._matcher.fill_bitmask(bitmask, row)
        else:
            bitmask[row].fill_(-1)   # free, as a row without a grammar

    def accept(self, token: int) -> bool:
        if self.ended:
            return self._matcher.accept(token)
        self.ended = token == self._end_id
        return True
