"""Implementations of the LoRA ops of lora/ops.py (which picks among them): torch_native (any
device), cpu_sgmv (the CPU's C kernel as torch ops), ascend (sgl_kernel_npu's kernels)."""
