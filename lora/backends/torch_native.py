"""The torch_native backend: the torch maths of lora/ops.py in every phase (CUDA; NPU and CPU on request;
the CPU without a C compiler). Eager phases run one GEMM pair per adapter present (the step's plan),
the graph phase the masked, fixed-shape ops over the static slot buffer."""
from __future__ import annotations

from lora.backends.base import LoRABackend


class TorchNativeBackend(LoRABackend):
    name = "torch_native"
