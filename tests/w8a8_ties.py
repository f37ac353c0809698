"""The engine's side of each int8 rounding tie, recorded and taken by the W8A8 reference (w8a8_reference.py).

Why: rounding an activation to int8 is discontinuous at x / scale = k + 0.5. The engine and transformers
compute the float parts between the quantized linears with last-bit differences: attention first (the
engine's SDPA over [H, T, D] with enable_gqa differs from transformers' SDPA in 4017 of 4864 outputs on the
same q, k, v; decode runs the engine's C kernel), then LoRA (each backend against PEFT), residuals and
norms downstream; rope and the first layer's quantized input are bit-identical. So |d(x / scale)| is up to
6e-5 at every later quantization input, on every LoRA backend, and an element closer than that to a tie
rounds the other way: sum |d(x / scale)| over a 14-request run (the expected number of such flips), qwen3:
1.17 cpu, 0.94 torch_native, 60 % of it at o_proj inputs (attention outputs). One flip moves its request's
later logprobs by 1e-2 to 3e-2 on these tiny random models (qwen3 torch_native, the rslora request: prefill
token 36, layer 1 qkv input, element 47: x / scale -6.5000086 in the reference, -6.4999986 in the engine).
A run without a flip is luck (e^-1.17 for cpu): changing only the order of the reference's two scale
multiplies moved llama / cpu from none to one. Aligning every float op bit for bit would mean replacing the
engine's attention kernels.

So the reference takes the engine's rounding where the two cannot be told apart: an element whose reference
x / scale lies within TIE of k + 0.5, in a row that the engine also quantized, to the same int8 values at
every element farther from a tie. Everything else (scales, every other element, the matmul, and the engine's
matmuls bit for bit on their own inputs: w8a8_reference.exact_w8a8_calls) stays the reference's own.
Measured: 0-3 elements taken per run; an activation scale 0.8 % off (max|x| / 126) takes none and still
fails 5 of 14 requests' tokens.
"""
from __future__ import annotations

import contextlib
import sys
from collections import Counter, defaultdict

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from w8a8_reference import ROW_PARALLEL
from workers.quant.kernels import dynamic_quant
from workers.quant.w8a8_linear import CHECKPOINT_MODULES, W8A8Linear

TIE = 1e-3   # 16x the largest |d(x / scale)| measured; a wrong scale or shard moves x / scale by far more
QLINEAR = "onednn::qlinear_pointwise"   # the oneDNN cpu kernel's int8 GEMM (a name: this module travels by value)
FUSED_LINEAR = "loraserve::w8a8_linear"  # the fused cpu kernel (workers/quant/cpu_w8a8.c): x in, y out
# a checkpoint module under a decoder layer -> our fused module that quantizes its input
FUSED = {module: fused for fused, modules in CHECKPOINT_MODULES.items() for module in modules}


class EngineRounding(TorchDispatchMode):
    """Records the int8 activations of every W8A8 matmul of one rank's `model` (cpu kernels) by layer, eager
    and replayed alike: each is one onednn.qlinear_pointwise call, whose weight names the layer, or one
    loraserve::w8a8_linear call, which quantizes inside: its int8 rows are its input's under the same
    arithmetic (dynamic_quant; the kernel is bit-exact to it: tests/test_w8a8_kernel.py)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.layers = {id(m.packed[0]): m.name for m in model.modules() if isinstance(m, W8A8Linear)}
        self.rows: dict[str, list[torch.Tensor]] = defaultdict(list)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name == QLINEAR and id(args[3]) in self.layers:
            self.rows[self.layers[id(args[3])]].append(args[0].clone())
        elif func._schema.name == FUSED_LINEAR and id(args[1]) in self.layers:
            self.rows[self.layers[id(args[1])]].append(dynamic_quant(args[0].reshape(-1, args[0].shape[-1]))[0])
        return out


class Ties:
    """The engine's int8 rows of one run by layer and rank ("layers.0.mlp.down_proj@1"), and the reference's
    side of the bargain: `adopt`."""

    def __init__(self):
        self.tables: dict[str, torch.Tensor] = {}
        self.adopted: Counter[str] = Counter()

    def add(self, rank: int, rows: dict[str, list[torch.Tensor]]) -> None:
        self.tables.update({f"{name}@{rank}": torch.cat(r).float() for name, r in rows.items()})

    def site(self, key: str, shard: int = 0) -> str:
        """The engine's layer (and rank) that quantizes shard `shard` of checkpoint module `key`'s input
        (model.layers.i.mlp.up_proj): a row-parallel layer's shard s on rank s, any other on rank 0."""
        index, _, module = key.removeprefix("model.layers.").partition(".")
        fused = FUSED[module]
        return f"layers.{index}.{fused}@{shard if fused.endswith(ROW_PARALLEL) else 0}"

    def rare(self) -> bool:
        """Whether fewer than one in 10^4 of the engine's int8 activations were taken (a run takes 0-3)."""
        return sum(self.adopted.values()) * 10_000 < sum(t.numel() for t in self.tables.values())

    def adopt(self, site: str, v: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        """xq [T, K] (the reference's round(v), v = x / scale) with the engine's choice at its ties."""
        near = (v - v.floor() - 0.5).abs() < TIE
        if not near.any():
            return xq
        engine = self.tables[site]
        for t in near.any(-1).nonzero().flatten().tolist():
            differ = engine != xq[t]
            same = ~(differ & ~near[t]).any(-1)     # engine rows equal to this one off its ties
            if same.any():
                candidates = same.nonzero().flatten()
                best = engine[candidates[differ[candidates].sum(-1).argmin()]]
                taken = near[t] & (best != xq[t])
                xq[t, taken] = best[taken]
                self.adopted[site] += int(taken.sum())
        return xq


def _record(actor) -> None:
    """On a rank's Ray actor: run each step under an EngineRounding."""
    recorder = EngineRounding(actor.runner.model)
    execute = actor.runner.execute

    def recorded(plan):
        with recorder:
            return execute(plan)
    actor.runner.execute, actor.w8a8_rounding = recorded, recorder


@contextlib.contextmanager
def engine_rounding(engine):
    """Yields a Ties, filled when the block ends with what every rank of `engine` quantized inside it (an
    in-process runner, or Ray actors reached by __ray_call__: this module travels by value)."""
    ties = Ties()
    ranks = getattr(engine.executor, "workers", None)
    if ranks is None:
        with EngineRounding(engine.executor.model) as recorder:
            yield ties
        ties.add(0, recorder.rows)
        return
    import ray   # only where the ranks are actors
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.get([rank.__ray_call__.remote(_record) for rank in ranks])
    yield ties
    rows = ray.get([rank.__ray_call__.remote(lambda actor: dict(actor.w8a8_rounding.rows)) for rank in ranks])
    for rank, r in enumerate(rows):
        ties.add(rank, r)
