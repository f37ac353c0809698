"""W8A8_DYNAMIC linear layers, replacing the float tensor-parallel linears they quantize.

`quantize_layer` swaps each linear the checkpoint describes as W8A8_DYNAMIC for a W8A8Linear as its
decoder layer is built, before the weights load (its float weight is dropped unread: at most one
layer's float linears are ever allocated, so a model that fits only in int8 still builds);
`finish_loading` checks what was loaded and packs it once for the kernel. A W8A8Linear keeps the
float layer's geometry (tp, out_sizes, out_offsets, shard_range, in_features) and its interface
(forward, and partial/reduce for a row-parallel one), so the LoRA wrappers of lora/layers.py wrap it
unchanged: the adapter's delta is computed from the unquantized input and added to the dequantized
output, in the model dtype, on every backend. TP cuts int8 weights and their scales like the float
weights: a column-parallel shard takes its output rows and their scales, a row-parallel shard its
input columns and all the scales (one per output row, which it keeps whole).
"""
from __future__ import annotations

import torch
from torch import nn

from workers.parallel import ColumnParallelLinear, RowParallelLinear, _narrow
from workers.quant.description import QuantizationError, W8A8Spec

# our fused module -> its checkpoint modules, by path under a decoder layer
CHECKPOINT_MODULES = {"self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                      "self_attn.o_proj": ["self_attn.o_proj"],
                      "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
                      "mlp.down_proj": ["mlp.down_proj"]}


class W8A8Linear(nn.Module):
    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear, kernel, name: str):
        super().__init__()
        self.kernel, self.name = kernel, name
        self.row = isinstance(layer, RowParallelLinear)
        out_features, in_features = layer.weight.shape
        device = layer.weight.device
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.weight_offset = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32, device=device),
                                          requires_grad=False)
        self.bias = layer.bias
        layer.weight, layer.bias = None, None
        self.packed = None
        # the float layer: geometry and shard ranges only (a plain attribute, not a submodule: its
        # float weight is released above, never loaded); set last, as __getattr__ falls back to it
        self.__dict__["layer"] = layer

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "layer" not in self.__dict__:
                raise
            return getattr(self.__dict__["layer"], name)

    def weight_loader(self, param: nn.Parameter, tensor_slice, shard: int = 0) -> None:
        layer = self.layer
        if self.row:
            if param is self.weight:
                src = _narrow(tensor_slice, 1, layer.tp.rank * layer.in_features, layer.in_features)
            else:  # scales, offsets and bias: one per output row, which a row-parallel shard keeps whole
                src = tensor_slice[:]
            dst = param.data
        else:
            start, size = layer.shard_range(shard)
            offset = layer.out_offsets[shard]
            src, dst = _narrow(tensor_slice, 0, start, size), param.data[offset:offset + size]
        if param is self.weight and src.dtype != torch.int8:
            raise QuantizationError(f"{self.name}: a W8A8_DYNAMIC weight must be int8, the checkpoint's is {src.dtype}")
        dst.copy_(src.reshape(dst.shape))

    def finish_loading(self) -> None:
        """Refuse what the int8 kernels would compute wrongly, then pack the weight once for the kernel."""
        if torch.count_nonzero(self.weight_offset).item():
            raise QuantizationError(f"{self.name}: non-zero weight_offset (asymmetric int8 weights) is not "
                                    f"implemented; W8A8_DYNAMIC weights here are symmetric")
        scale = self.weight_scale.detach().flatten()
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise QuantizationError(f"{self.name}: weight_scale must be finite and positive")
        self.packed = self.kernel.pack(self.weight.detach(), scale)
        self.weight = nn.Parameter(self.packed[0], requires_grad=False)   # the kernel's copy, counted once
        self.weight_scale = nn.Parameter(self.packed[1], requires_grad=False)
        self.weight_offset = None

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """Row-parallel: this rank's partial sum, before the all-reduce (the bias is added once, after)."""
        return self.kernel(x, self.packed, None)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        y = self.layer.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        if self.row:
            return self.reduce(self.partial(x))
        return self.kernel(x, self.packed, self.bias)


def quantize_layer(spec: W8A8Spec, kernel, index: int, decoder: nn.Module) -> int:
    """Replace the linears of decoder layer `index` that the spec quantizes by W8A8Linears (before loading);
    called as each layer is built, so only one layer's float linears ever exist. Returns how many."""
    count = 0
    for path, checkpoint_modules in CHECKPOINT_MODULES.items():
        if not spec.quantized(index, checkpoint_modules):
            continue
        parent_path, _, attr = path.rpartition(".")
        parent = decoder.get_submodule(parent_path)
        setattr(parent, attr, W8A8Linear(getattr(parent, attr), kernel, f"layers.{index}.{path}"))
        count += 1
    return count


def check_described(spec: W8A8Spec, num_layers: int) -> None:
    """Every module the description quantizes is one the model has."""
    described = {(i, m) for i in range(num_layers) for ms in CHECKPOINT_MODULES.values() for m in ms}
    unknown = sorted(spec.modules - described)
    if unknown:
        raise QuantizationError(f"W8A8_DYNAMIC modules the model does not have: {unknown[:4]}")


def finish_loading(model: nn.Module) -> None:
    for module in list(model.modules()):
        if isinstance(module, W8A8Linear):
            module.finish_loading()
