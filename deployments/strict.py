"""Strict and honest request models: unknown fields, wrong types and NaN are refused (a 400 naming the field);
a model may list `harmless` fields (accepted and dropped) and `unsupported` ones (accepted only at the
values that mean "off"), so a request is never silently served differently from what it asked for."""
from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


def _is_off(value: Any, offs: tuple) -> bool:
    """Type-exact: `true` is not 1 and `1.5` is not "off"; 0 and 0.0 are the same number."""
    def same(off: Any) -> bool:
        if off is None or isinstance(off, bool) or isinstance(value, bool):
            return value is off           # None, true and false are singletons
        if isinstance(off, (int, float)):
            return isinstance(value, (int, float)) and value == off
        return type(value) is type(off) and value == off
    return any(same(off) for off in offs)


def shown(value: Any) -> str:
    """A caller's value as JSON, cut short (it is echoed in an error message)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class StrictModel(BaseModel):
    """extra="forbid" + strict types; `harmless` fields are dropped, `unsupported` ones pass only when "off"."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)   # JSON NaN is no sampling value
    harmless: ClassVar[frozenset[str]] = frozenset()
    unsupported: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _only_what_is_served(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kept = {}
        for field, value in data.items():
            if field in cls.harmless:
                continue
            if field in cls.unsupported and field not in cls.model_fields:
                offs = cls.unsupported[field]
                if not _is_off(value, offs):
                    raise PydanticCustomError("unsupported_parameter",
                                              "{field}={value} is not supported by this server (only {offs})",
                                              {"field": field, "value": shown(value),
                                               "offs": " or ".join(shown(o) for o in offs if o is not None)
                                               or "null"})
                continue
            kept[field] = value
        return kept
