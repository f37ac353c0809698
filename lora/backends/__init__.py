"""LoRA backends, one object per model runner chosen once by name (as SGLang's `get_backend_from_name`):
torch_native (lora/backends/torch_native.py), cpu (the C kernel, cpu_sgmv.py), ascend (sgl_kernel_npu,
ascend.py); the interface is base.py's, the maths they are tested against lora/ops.py's."""
from __future__ import annotations

import logging

import torch

from lora.backend_names import BACKENDS, DEFAULTS
from lora.backends import ascend, ascend_probe, cpu_sgmv
from lora.backends.base import LoRABackend

log = logging.getLogger(__name__)


def get_backend(name: str | None, device: torch.device | str, dtype: torch.dtype, max_rank: int) -> LoRABackend:
    """The backend `name` (None: the device's default) for a runner; RuntimeError / ValueError at start-up
    when an asked-for backend cannot run here. A default whose kernels are absent becomes torch_native,
    said once (never a crash loop for a missing optional package)."""
    from lora.backends.torch_native import TorchNativeBackend
    device = torch.device(device)
    chosen = name or DEFAULTS.get(device.type, "torch_native")
    if chosen not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {chosen!r}; known backends: {', '.join(BACKENDS)}")
    if chosen == "torch_native":
        return TorchNativeBackend(device, dtype, max_rank)
    want = {"cpu": "cpu", "ascend": "npu"}[chosen]
    if device.type != want:
        raise ValueError(f"lora_backend {chosen!r} runs on {want} only, not on {device.type}; use torch_native")
    if chosen == "cpu":
        if cpu_sgmv.available():
            return cpu_sgmv.CpuBackend(device, dtype, max_rank)
        reason = "the CPU LoRA kernel is unavailable (see lora/native.py's warning)"
    else:
        reason = ascend_probe.unavailable_reason(device, dtype)
        if reason is None:   # the probe passed: its answer is cached
            contract = ascend_probe.installed_contract(device, dtype)
            return ascend.AscendBackend(device, dtype, max_rank, contract=contract)
    if name is not None:
        raise RuntimeError(f"lora_backend {chosen!r}: {reason}; set lora_backend: torch_native")
    log.warning("LoRA backend %s: %s; running torch_native (same results, slower)", chosen, reason)
    return TorchNativeBackend(device, dtype, max_rank)

