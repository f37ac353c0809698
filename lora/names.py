"""The adapter-name rule, in one place: the ingress, the config, the replica and the engine check names here
(a module of its own so that checking a name imports no torch)."""
from __future__ import annotations

import re

from lora.errors import AdapterError

# A name is a routing key (`<base>:<adapter>`), a metric label and a log field: no ':', '/', spaces, newlines.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_adapter_name(name: object, base_model: str | None = None) -> str:
    """`name` if it is a valid adapter name (and not the served base model's), else AdapterError saying why."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        shown = repr(name[:64] + "..." if isinstance(name, str) and len(name) > 64 else name)
        raise AdapterError(f"adapter name {shown} is invalid: expected 1 to 128 letters, digits, '.', '_' or '-', "
                           "starting with a letter or digit")
    if name == base_model:
        raise AdapterError(f"adapter name {name!r} is the served base model's name; choose another")
    return name
