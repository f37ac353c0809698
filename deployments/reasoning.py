"""A thinking model's reasoning apart from its answer in chat responses (vLLM's `--reasoning-parser qwen3`).

Qwen3 writes `<think>reasoning</think>answer`. Its newer chat templates put `<think>` in the prompt, so the
output may start inside the reasoning and show only `</think>`: everything before `</think>` is reasoning
(a `<think>` the model writes itself is dropped), everything after it is the answer, and an output cut
before `</think>` is all reasoning. A prompt whose last think tag is `</think>` (`enable_thinking: false`
closes an empty think block there) leaves nothing to split: the whole output is the answer. The grammar of
a constrained request follows the same rule (workers/reasoning.py), so the answer is what it constrains.

The reasoning goes out under both names clients read: `reasoning_content` (DeepSeek's, which vLLM used
first, and what LiteLLM, LangChain's reasoning integrations, Qwen-Agent and the Vercel AI SDK read) and
`reasoning` (vLLM's name since it renamed the field, the only one it writes now).
"""
from __future__ import annotations

from workers.reasoning import ThinkTokens

FIELDS = ("reasoning_content", "reasoning")


def _held_back(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (it may become one)."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


class ReasoningParser:
    """One choice's output as it is generated: feed(text) -> (reasoning, content); finish() at its end."""

    def __init__(self, tags: ThinkTokens, prompt_token_ids):
        self.tags = tags
        self._reasoning = not tags.reasoning_ended(prompt_token_ids)
        self._held = ""          # the end of the reasoning so far that may be the start of a tag

    def feed(self, text: str) -> tuple[str, str]:
        if not self._reasoning:
            return "", text
        text, self._held = self._held + text, ""
        before, end, after = text.partition(self.tags.end)
        if end:
            self._reasoning = False
            return self._drop_start(before), after
        cut = len(text) - _held_back(text, (self.tags.start, self.tags.end))
        self._held = text[cut:]
        return self._drop_start(text[:cut]), ""

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return (held, "") if self._reasoning else ("", held)

    def _drop_start(self, reasoning: str) -> str:
        return reasoning.replace(self.tags.start, "")


def split_reasoning(tags: ThinkTokens, prompt_token_ids, text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole output."""
    parser = ReasoningParser(tags, prompt_token_ids)
    reasoning, content = parser.feed(text)
    tail_reasoning, tail_content = parser.finish()
    return (reasoning + tail_reasoning) or None, content + tail_content


def reasoning_fields(reasoning: str | None) -> dict[str, str]:
    return dict.fromkeys(FIELDS, reasoning) if reasoning else {}
