"""What LLMServer's handle methods (`generate`, `generate_choices`, `generate_stream`) return to in-cluster
callers."""
from __future__ import annotations

import dataclasses

from workers.sequence import RequestOutput


@dataclasses.dataclass
class ServedOutput(RequestOutput):
    """A RequestOutput plus where it was served; stream items carry only what is new since the last one."""
    num_prompt_tokens: int = 0
    replica_id: str = ""
    index: int = 0                                   # which choice of the request (n > 1)
    prompt_text: str | None = None                   # with echo: the prompt as text
    token_names: dict[int, tuple[str, list[int]]] | None = None   # token id -> (text, UTF-8 bytes)
