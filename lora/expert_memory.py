"""The memory rule of expert LoRA slots, said at start-up.

An expert slot holds a rank-R pair for every expert of every sparse layer: per slot
    sum over sparse layers and expert groups of  E * R * (stack * in + sum(out)) * dtype bytes
(this rank's cut under TP), e.g. Qwen3-30B-A3B at R = 16 in bf16: 48 layers x 128 experts x
16 x (2 x 2048 + 2 x 768 + 768 + 2048) x 2 B ~ 1.7 GB a slot (gate and up have an A each: per-expert
adapters train them apart), against ~27 MB for its attention LoRA.
The slots are allocated once (graphs read them in place), so a configuration whose expert slots do
not fit is refused before anything is allocated, with what would fit.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import torch

from lora.modules import EXPERT_GROUPS


def expert_slot_bytes(groups: dict, num_layers: int, max_rank: int, dtype: torch.dtype) -> int:
    """Bytes of one slot's expert buffers (all sparse layers, this rank's cut) for slot-pool `groups`."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for name, shape in groups.items():
        if name in EXPERT_GROUPS:
            layers = num_layers if shape.layers is None else len(shape.layers)
            total += layers * shape.experts * max_rank * (len(shape.out_dims) * shape.in_dim + sum(shape.out_dims))
    return total * size


def free_memory(device: torch.device) -> int | None:
    """Bytes free on `device` now (host memory for the CPU); None where the runtime cannot say."""
    if device.type == "cpu":   # Linux's estimate of what can be allocated without swapping (no psutil at run time)
        try:
            with open("/proc/meminfo") as meminfo:
                fields = dict(line.split(":", 1) for line in meminfo)
            return int(fields["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    mem_get_info = getattr(getattr(torch, device.type, None), "mem_get_info", None)
    return mem_get_info(device)[0] if mem_get_info is not None else None


def check_expert_slots(groups: dict, num_layers: int, num_slots: int, max_rank: int, dtype: torch.dtype,
                       budget: Callable[[], int | None], budget_source: str) -> str | None:
    """The start-up report of the expert slots (None: no expert LoRA), or ValueError saying what would fit.
    `budget()`: the bytes they may take (None: unknown, reported only)."""
    per_slot = expert_slot_bytes(groups, num_layers, max_rank, dtype)
    if not per_slot:
        return None
    gb = 2 ** 30
    need, budget = per_slot * num_slots, budget()
    report = (f"expert LoRA slots (max_expert_loras): {num_slots} x {per_slot / gb:.3f} GB = {need / gb:.3f} GB "
              f"(max_lora_rank {max_rank}, {str(dtype).removeprefix('torch.')}, this rank's cut), "
              + (f"{budget_source} {budget / gb:.3f} GB" if budget is not None else f"{budget_source} unknown"))
    if budget is None or need <= budget:
        return report
    slots = budget // per_slot
    rank = budget // (num_slots * (per_slot // max_rank))
    options = [f"max_expert_loras <= {slots}" if slots else None,
               f"max_lora_rank <= {rank}" if rank else None,
               "lora_target_modules without experts.gate_proj / experts.up_proj / experts.down_proj"]
    raise ValueError(f"{report}: the expert LoRA slots do not fit; what would: "
                     + ", or ".join(o for o in options if o))
