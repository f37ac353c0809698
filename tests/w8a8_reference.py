"""A plain-torch reference of W8A8_DYNAMIC arithmetic, put into the transformers + PEFT oracle.

Each quantized projection of the HF model (under PEFT's LoRA wrapper, whose delta is computed from
the layer's unquantized input) becomes RefW8A8Linear over the quantized checkpoint's own tensors:
per-token symmetric int8 activations (max|x|/127, round half to even), the integer matmul done
exactly in float64, then scaled by the channel's and then the token's scale in fp32: the engine's
order, so that on the same input a matmul is bit-identical (`exact_w8a8_calls` checks every eager
one of a run). Under tensor parallelism a row-parallel layer (o_proj, down_proj) quantizes each
rank's slice of its input on its own (per token, per shard, as vllm-ascend does) and sums the
partial outputs: `tp` reproduces that. Where an activation lies on a rounding tie, the reference
takes the engine's side (w8a8_ties.py says why and how), so that `assert_matches_reference` holds
the acceptance rule as written: greedy tokens identical, |dlogprob| < 1e-3 for every request.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from workers.quant.w8a8_linear import CHECKPOINT_MODULES, W8A8Linear
from workers.tape_graph import _Recorder

TINY = torch.finfo(torch.float32).tiny


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   adopt=None) -> torch.Tensor:
    """x [..., in] float; q int8 [out, in]; scale [out, 1] -> x's dtype. adopt(x / scale, xq) -> xq: the
    engine's side of rounding ties (w8a8_ties.py), on [tokens, in]."""
    xf = x.float()
    x_scale = (xf.abs().amax(-1, keepdim=True) / 127.0).clamp_min(TINY)
    xq = torch.round(xf / x_scale).clamp(-127, 127)
    if adopt is not None:
        xq = adopt((xf / x_scale).reshape(-1, xf.shape[-1]), xq.reshape(-1, xf.shape[-1])).reshape(xq.shape)
    acc = (xq.double() @ q.double().T).float()   # exact: |acc| < 2**24 at these sizes
    y = acc * scale.float().reshape(-1) * x_scale   # the engine's order (workers/quant/kernels.py): bit-exact
    return (y if bias is None else y + bias.float()).to(x.dtype)


ROW_PARALLEL = ("o_proj", "down_proj")


class RefW8A8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, shards: int = 1,
                 ties=None, key: str = ""):
        super().__init__()
        self.q, self.scale, self.bias, self.shards = q, scale, bias, shards
        self.ties, self.key = ties, key   # a w8a8_ties.Ties, and this module's checkpoint name for it
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.weight = nn.Parameter((q.float() * scale.float()), requires_grad=False)  # dtype/device for PEFT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shards == 1:
            return w8a8_reference(x, self.q, self.scale, self.bias, self.adopt(0))
        parts = [w8a8_reference(xs, qs, self.scale, None, self.adopt(shard))
                 for shard, (xs, qs) in enumerate(zip(x.chunk(self.shards, -1), self.q.chunk(self.shards, -1)))]
        y = sum(parts[1:], parts[0])
        return y if self.bias is None else y + self.bias

    def adopt(self, shard: int):
        return None if self.ties is None else functools.partial(self.ties.adopt, self.ties.site(self.key, shard))


def quantized_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(os.fspath(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def install_reference(hf_model: nn.Module, quantized_path: Path, tp: int = 1, ties=None) -> int:
    """Replace every nn.Linear of `hf_model` (a PEFT model or a bare HF one) that the quantized checkpoint
    has as int8 by RefW8A8Linear (of `tp` ranks' arithmetic, taking the rounding ties of `ties`, a
    w8a8_ties.Ties, if given). Returns how many were replaced."""
    tensors = quantized_tensors(quantized_path)
    count = 0
    for name, module in list(hf_model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        key = name.removeprefix("base_model.model.").removesuffix(".base_layer")
        if tensors.get(f"{key}.weight", torch.empty(0)).dtype != torch.int8:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = hf_model.get_submodule(parent_name)
        shards = tp if key.endswith(ROW_PARALLEL) else 1
        setattr(parent, attr, RefW8A8Linear(tensors[f"{key}.weight"], tensors[f"{key}.weight_scale"], module.bias,
                                            shards, ties, key))
        count += 1
    return count


@contextlib.contextmanager
def exact_w8a8_calls(model: nn.Module, quantized_path: Path):
    """Every W8A8 matmul of `model` (one rank, TP 1) run eagerly inside the block must equal w8a8_reference on
    its own input bit for bit; yields a Counter of the checked calls by layer. Calls under a capture's
    dispatch mode (workers/tape_graph.py refuses host reads there) run unchecked; their replays are the
    end-to-end comparison's."""
    tensors = quantized_tensors(quantized_path)
    checked: Counter[str] = Counter()
    modules = [m for m in model.modules() if isinstance(m, W8A8Linear)]

    def checking(module, kernel):
        index, _, path = module.name.removeprefix("layers.").partition(".")
        keys = [f"model.layers.{index}.{m}" for m in CHECKPOINT_MODULES[path]]
        q = torch.cat([tensors[f"{k}.weight"] for k in keys])
        scale = torch.cat([tensors[f"{k}.weight_scale"] for k in keys])

        def call(x, packed, bias):
            y = kernel(x, packed, bias)
            if not any(isinstance(m, _Recorder) for m in _get_current_dispatch_mode_stack()):
                expected = w8a8_reference(x, q, scale, bias)
                assert torch.equal(y, expected), (module.name, (y - expected).abs().max().item())
                checked[module.name] += 1
            return y
        return call

    kernels = [module.kernel for module in modules]
    for module, kernel in zip(modules, kernels):
        module.kernel = checking(module, kernel)
    try:
        yield checked
    finally:
        for module, kernel in zip(modules, kernels):
            module.kernel = kernel


def assert_matches_reference(requests, outs, expected) -> list[float]:
    """Greedy tokens identical and |dlogprob| < 1e-3 for every request. Returns each one's max |dlogprob|."""
    worst = []
    for (prompt, name), out, (tokens, logprobs) in zip(requests, outs, expected):
        assert out.token_ids == tokens, (prompt, name)
        worst.append(max(abs(a - b) for a, b in zip(out.logprobs, logprobs)))
    assert max(worst) < 1e-3, worst
    return worst
