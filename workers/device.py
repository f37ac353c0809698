"""Platforms: cpu / cuda / npu. `torch_npu` is imported only on the npu platform.

torch is imported where a platform touches a device, not at the top: validating a config (the ingress, the
CLI) needs only the names and rules here, and the ingress imports no torch (tests/test_ingress_imports.py).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Platform:
    name: str                    # "cpu" | "cuda" | "npu"
    dist_backend: str            # torch.distributed backend
    ray_resource: str            # Ray resource one worker asks for (EngineConfig.device_resource may rename it)
    visible_devices_env: str | None
    supports_graphs: bool

    def torch_device(self, index: int = 0) -> torch.device:
        import torch
        return torch.device("cpu") if self.name == "cpu" else torch.device(self.name, index)

    def set_device(self, index: int) -> None:
        if self.name != "cpu":
            import torch
            getattr(torch, self.name).set_device(index)

    def graph(self):
        """A new device graph object (CUDAGraph / NPUGraph)."""
        import torch
        if self.name == "cuda":
            return torch.cuda.CUDAGraph()
        if self.name == "npu":
            return torch.npu.NPUGraph()
        raise RuntimeError("graph capture is not available on cpu")

    def graph_context(self, graph, pool=None):
        import torch
        return getattr(torch, self.name).graph(graph, pool=pool)

    def default_dtype(self, checkpoint_dtype: str | None) -> str:
        """`dtype: auto`: the checkpoint's dtype (as HF's `dtype="auto"`), 16-bit ones made bf16 on a CPU that
        has bf16 instructions (AVX512-BF16 / AMX: oneDNN's bf16 GEMMs run 2-5x its fp32 ones) and fp32 on one
        without (bf16 would be emulated, slower). fp32 checkpoints stay fp32: `--dtype bfloat16` opts in. A 310P
        NPU has no bf16: 16 bits are fp16 there. Its name is read from the device this process sees; a process that sees none (a TP > 1 replica: Ray hides the
        NPUs from it) cannot tell, and a 310P deployment of that kind sets `dtype: float16` itself."""
        import torch
        half = "bfloat16"
        if self.name == "npu":
            try:   # torch_npu is loaded on this platform (get_platform); a hidden device reads as none
                if torch.npu.device_count() > 0 and "310P" in torch.npu.get_device_name(torch.npu.current_device()):
                    half = "float16"
            except Exception:   # no driver or no device in this process: the name is unknown
                pass
        if checkpoint_dtype not in ("float16", "bfloat16"):
            return "float32" if self.name == "cpu" or checkpoint_dtype == "float32" else half
        if self.name == "npu" and half == "float16":
            return "float16"
        if self.name != "cpu":
            return checkpoint_dtype
        return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"

    def synchronize(self) -> None:
        if self.name != "cpu":
            import torch
            getattr(torch, self.name).synchronize()


PLATFORMS = {
    "cpu": Platform("cpu", "gloo", "CPU", None, False),
    "cuda": Platform("cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES", True),
    "npu": Platform("npu", "hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES", True),
}


# Tokens per step (max_num_batched_tokens) when the config leaves it unset: decodes first, prefill chunks
# fill the rest. On the CPU (bench shape, 2 cores; benchmarks/RESULTS.md "Scheduling") 8 LoRA streams
# decode in ~70 ms a step and a prompt token adds ~1 ms: 128 keeps a chunk step at ~200-250 ms (256: ~300,
# 512: ~500-850) and still prefills a 2,000-token prompt faster than one unchunked step; accelerators
# take vLLM's serving default.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 128, "cuda": 2048, "npu": 2048}


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:  # an installed torch_npu without CANN fails to import
        return False
    import torch
    return torch.npu.is_available()


def check_device_resource(device: str, device_resource: str | None) -> None:
    """Only a cpu worker may reserve another Ray resource than its device's: Ray hands out GPUs and NPUs
    (CUDA_ / ASCEND_RT_VISIBLE_DEVICES) through exactly their own resource."""
    if device_resource is None or device not in PLATFORMS:
        return
    own = PLATFORMS[device].ray_resource
    if device != "cpu" and device_resource != own:
        raise ValueError(f"device_resource={device_resource!r} with device={device!r}: a {device} worker must "
                         f"reserve {own!r} (Ray assigns {device} devices through it); a different resource is for "
                         "device='cpu' workers placed on nodes that advertise it")


def get_platform(device: str = "auto", device_resource: str | None = None) -> Platform:
    """The platform for `device` ("auto" picks npu, then cuda, then cpu), reserving `device_resource` if given."""
    import torch
    if device == "auto":
        device = "npu" if _npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    if device not in PLATFORMS:
        raise ValueError(f"device must be one of auto, {', '.join(PLATFORMS)}; got {device!r}")
    check_device_resource(device, device_resource)
    if device == "npu":
        import torch_npu  # noqa: F401
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False")
    platform = PLATFORMS[device]
    if device_resource and device_resource != platform.ray_resource:
        platform = dataclasses.replace(platform, ray_resource=device_resource)
    return platform
