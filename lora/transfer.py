"""The one way host data reaches a device (DESIGN: Devices).

Non-blocking from pinned memory where this process may pin: only a process that holds the
device it copies to (the in-process worker of a TP 1 engine, or a worker actor). A replica that
drives remote workers reserves no device (Ray hides every NPU from it), and torch_npu's pinned
allocator initialises a device there: it must never pin (`allow_pinning` is off by default).
"""
from __future__ import annotations

import torch

_pinning = False


def allow_pinning(allowed: bool) -> None:
    """Called by a worker for the device it holds: from then on host->device copies are pinned."""
    global _pinning
    _pinning = allowed


def to_device(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host tensor (or Python data) on `device`; on the CPU the host tensor itself."""
    device = torch.device(device)
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type == "cpu" or host.device == device:
        return host
    if _pinning and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
