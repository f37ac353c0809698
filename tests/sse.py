"""Server-sent events as the replica renders them (deployments/render.py): text -> the parsed events."""
from __future__ import annotations

import json


def events(text: str) -> list:
    assert text.endswith("\n\n")
    chunks = text.split("\n\n")[:-1]
    assert all(c.startswith("data: ") for c in chunks)
    return [c[6:] if c == "data: [DONE]" else json.loads(c[6:]) for c in chunks]
