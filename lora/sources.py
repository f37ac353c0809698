"""Where an adapter lives: a local directory inside the allowed roots, or a Hub snapshot; its files opened safely.

Every error names the adapter. With adapter roots, a refusal says nothing about
a path outside them (whether it exists, is a directory or a symlink).
"""
from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Sequence

import huggingface_hub
from huggingface_hub.errors import HFValidationError

from lora.errors import AdapterConfigError, AdapterError, AdapterNotFoundError, AdapterPathError

# `org/name` or `org/name@revision`; anything else that does not exist is a missing path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
# A PEFT adapter's files (read by peft_format; named here, apart from torch, for the config's early check).
CONFIG_NAME = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
PICKLED_NAME = "adapter_model.bin"   # refused: unpickling runs code
HUB_FILES = (CONFIG_NAME, SAFETENSORS_NAME)   # what a PEFT adapter needs


def is_hub_id(source: str) -> bool:
    return _HUB_ID.fullmatch(source) is not None


def resolve_source(name: str, source: str, adapter_roots: Sequence[str] | None,
                   allow_hub: bool = True) -> tuple[Path, Sequence[str]]:
    """The directory holding the adapter, and the roots its files must stay inside.

    With roots, an `org/name` source is always a Hub id (a relative local path inside a root is
    written `./org/name` or absolute), and every local refusal is one message: whether a path
    outside the roots exists, is a directory or is a symlink is never told.
    """
    roots = adapter_roots or ()
    if check_source_allowed(name, source, roots, allow_hub):
        return _snapshot(name, source), ()   # Hub snapshots live in the HF cache, which the roots do not restrict
    path = Path(source)
    if not path.is_dir():
        raise AdapterNotFoundError(f"adapter {name!r}: source {source!r} is not a directory nor a Hub id (org/name)")
    return path, roots


def check_source_allowed(name: str, source: str, adapter_roots: Sequence[str] | None, allow_hub: bool) -> bool:
    """The adapter roots' rule, for a hot-load before anything is published and for every load: a Hub id
    only where allowed, a local source only as a directory inside the roots (one refusal, whatever a path
    outside them is). True when `source` is a Hub id."""
    roots = adapter_roots or ()
    if is_hub_id(source) and (roots or not os.path.exists(source)):
        if not allow_hub:
            raise AdapterPathError(f"adapter {name!r}: {source!r} is not a local directory and Hub ids are "
                                   "not allowed with adapter_roots (allow_hub_adapters=True permits them)")
        return True
    if roots and not (_inside_roots(Path(source), roots) and os.path.isdir(source)):
        raise AdapterPathError(f"adapter {name!r}: {source!r} is not an adapter directory inside the "
                               "allowed adapter roots")
    return False


def _inside_roots(path: Path, roots: Sequence[str]) -> bool:
    """realpath defeats `..` and symlinks."""
    real = os.path.realpath(path)
    return any(os.path.commonpath([real, os.path.realpath(root)]) == os.path.realpath(root) for root in roots)


def check_inside_roots(name: str, path: Path, roots: Sequence[str]) -> None:
    """Refuse a file of the adapter that resolves outside the roots (a symlink out of them)."""
    if roots and not _inside_roots(path, roots):
        raise AdapterPathError(f"adapter {name!r}: {path.name} resolves outside the allowed adapter roots")


def regular_file(name: str, path: Path, missing_error: type[AdapterError] = AdapterNotFoundError) -> os.stat_result:
    """Stat `path` and refuse anything but a regular file before it is opened: a FIFO would block the
    reader forever, a device or socket is no adapter file."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise missing_error(f"adapter {name!r}: {path.name} missing in {str(path.parent)!r}") from None
    except OSError as error:
        raise AdapterConfigError(f"adapter {name!r}: cannot read {path.name} ({error.strerror})") from error
    if not stat.S_ISREG(info.st_mode):
        raise AdapterConfigError(f"adapter {name!r}: {path.name} is not a regular file")
    return info


def read_small_file(name: str, path: Path, limit: int) -> bytes:
    regular_file(name, path, AdapterConfigError)
    # O_NONBLOCK + fstat: a file swapped for a FIFO after the stat above still cannot block the open.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AdapterConfigError(f"adapter {name!r}: {path.name} is not a regular file")
        if info.st_size > limit:
            raise AdapterConfigError(f"adapter {name!r}: {path.name} is {info.st_size} bytes, over the "
                                     f"limit of {limit}")
        with os.fdopen(fd, "rb", closefd=False) as file:
            return file.read(limit + 1)
    finally:
        os.close(fd)


def _snapshot(name: str, source: str) -> Path:
    repo_id, _, revision = source.partition("@")
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision or None, allow_patterns=list(HUB_FILES))
    except (OSError, HFValidationError) as error:  # the detail (it may name cache paths) stays in the log
        raise AdapterNotFoundError(f"adapter {name!r}: Hub repo {source!r} is unavailable (not found, not "
                                   "public, a bad revision, or offline and not cached)") from error
    return Path(folder)
