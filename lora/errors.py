"""Adapter errors. Each message names the adapter, the field and the limit.

All derive from `AdapterError(ValueError)` so callers can treat them as bad input.
"""


class AdapterError(ValueError):
    """Base class: an adapter cannot be loaded or used."""


class AdapterNotFoundError(AdapterError):
    """The source (directory, file or Hub id) does not exist, or the adapter name is unknown."""


class AdapterConfigError(AdapterError):
    """adapter_config.json is missing or malformed."""


class AdapterRankError(AdapterError):
    """A rank is above max_lora_rank (or not positive)."""


class AdapterTargetError(AdapterError):
    """A target module the base model does not have (or that LoRA serving does not support)."""


class AdapterShapeError(AdapterError):
    """A tensor's shape does not match the base model."""


class AdapterUnsupportedError(AdapterError):
    """A PEFT feature this server does not implement: DoRA, bias, modules_to_save, pickled weights."""


class AdapterWeightsError(AdapterError):
    """Weights are missing or non-finite."""


class AdapterPathError(AdapterError):
    """A local path outside the configured adapter roots."""


class AdapterLoadTimeoutError(AdapterError):
    """Reading an adapter (disk or Hub) took longer than the configured timeout."""
