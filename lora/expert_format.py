"""Expert LoRA (Qwen3-MoE) in the two formats users have, read into one form.

Per (layer, module) with module experts.gate_proj / experts.up_proj / experts.down_proj:
lora_a [E, r, in] and lora_b [E, out, r] (expert e's pair is [e]), plus its scaling.

- PEFT `target_parameters` on the fused experts (PEFT 0.21's ParamWrapper, one LoRA per 3-D
  parameter): A [r*E, in] holds expert e's rows at e*r .. (e+1)*r; B [out, r*E] holds expert e's
  columns at e, e+E, e+2E, ... (ParamWrapper.get_delta_weight reshapes A to [E, r, in] and B to
  [out, r, E]; checked against PEFT in tests/test_moe_lora.py). gate_up_proj: in = hidden,
  out = 2 * moe_intermediate (gate rows first), so gate and up share A; down_proj: in =
  moe_intermediate, out = hidden. The key names do not say which parameter a pair is (the inner
  wrapper is `experts.base_layer`, whichever parameter that was), the shapes do: A [rE, H] /
  B [2I, rE] against A [rE, I] / B [H, rE] can never coincide.
- per-expert 2-D keys (adapters trained on transformers 4.x; vLLM's default):
  `...mlp.experts.<e>.{gate,up,down}_proj.lora_A.weight [r, in]` / `lora_B.weight [out, r]`. Experts
  the adapter leaves out add zero; per-expert ranks are zero-padded to the largest, and per-expert
  scalings (rank_pattern / alpha_pattern) folded into B when they differ.
The router (`mlp.gate`) is not a LoRA target: refused by name.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch

from lora.errors import AdapterRankError, AdapterShapeError, AdapterTargetError

_FUSED = re.compile(r"(?:.*\.)?layers\.(\d+)\.mlp\.experts(?:\.base_layer)*")
_PER_EXPERT = re.compile(r"(?:.*\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj")
_ROUTER = re.compile(r"(?:.*\.)?layers\.(\d+)\.mlp\.gate")
EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")   # target_parameters we read
ROUTER_REFUSAL = ("the MoE router (mlp.gate) is not a supported LoRA target; expected LoRA on attention, dense MLPs "
                  "and the experts (mlp.experts.gate_up_proj / down_proj)")


def is_router(module_path: str) -> bool:
    return _ROUTER.fullmatch(module_path) is not None


def split_expert_pairs(name: str, pairs: list, settings, spec, max_lora_rank: int, fp32: Callable) -> tuple[list, dict]:
    """(the pairs that are not expert LoRA, {(layer, module): (lora_a [E, r, in], lora_b [E, out, r], scaling)})."""
    rest, fused, per_expert = [], [], {}
    for pair in pairs:
        if is_router(pair.module_path):
            raise AdapterTargetError(f"adapter {name!r}: {pair.module_path!r}: {ROUTER_REFUSAL}")
        if (match := _FUSED.fullmatch(pair.module_path)) is not None:
            fused.append((int(match[1]), pair))
        elif (match := _PER_EXPERT.fullmatch(pair.module_path)) is not None:
            layer, expert, proj = int(match[1]), int(match[2]), match[3]
            per_expert.setdefault((layer, f"experts.{proj}_proj"), {})[expert] = pair
        else:
            rest.append(pair)
    out = {}
    for layer, pair in fused:
        for module, weights in _read_fused(name, layer, pair, settings, spec, max_lora_rank, fp32).items():
            _put(name, out, (layer, module), weights)
    for (layer, module), experts in per_expert.items():
        _put(name, out, (layer, module), _stack(name, layer, module, experts, settings, spec, max_lora_rank, fp32))
    return rest, out


def _put(name: str, out: dict, key: tuple[int, str], weights) -> None:
    if key in out:
        raise AdapterTargetError(f"adapter {name!r}: layer {key[0]} {key[1]} is given twice (fused target_parameters "
                                 "and per-expert keys, or a parameter twice); expected one")
    out[key] = weights


def _check_layer(name: str, layer: int, what: str, spec) -> None:
    if not spec.num_experts:
        raise AdapterTargetError(f"adapter {name!r}: {what} targets experts, but the base model has none")
    if layer not in spec.sparse_layers:
        raise AdapterTargetError(f"adapter {name!r}: {what} targets experts in layer {layer}, which has none; "
                                 f"expected one of the sparse layers {sorted(spec.sparse_layers)}")


def _read_fused(name: str, layer: int, pair, settings, spec, max_lora_rank: int, fp32: Callable) -> dict:
    _check_layer(name, layer, repr(pair.a_key), spec)
    E = spec.num_experts
    H, I = spec.module_dims["experts.gate_proj"][0], spec.module_dims["experts.down_proj"][0]
    experts_path = pair.module_path[:pair.module_path.index(".mlp.experts") + len(".mlp.experts")]
    shapes = (tuple(pair.a.shape), tuple(pair.b.shape))
    expected = []
    for proj, in_dim, out_dim in (("gate_up", H, 2 * I), ("down", I, H)):
        # PEFT keys rank_pattern / alpha_pattern by the parameter's path (its MoE conversion writes
        # `.*\.gate_up_proj`: gate and up fused at twice the rank and alpha)
        rank, scaling = settings.rank_and_scaling(f"{experts_path}.{proj}_proj")
        want = ((rank * E, in_dim), (out_dim, rank * E))
        expected.append(f"{[list(w) for w in want]} (mlp.experts.{proj}_proj, rank {rank} x {E} experts)")
        if shapes == want:
            break
    else:
        raise AdapterShapeError(f"adapter {name!r}: {pair.a_key!r} / {pair.b_key!r} have shapes "
                                f"{[list(s) for s in shapes]}, expected {' or '.join(expected)}")
    _check_rank(name, f"{experts_path}.{proj}_proj", rank, max_lora_rank)
    a = fp32(pair.a_key, pair.a).view(E, rank, -1)
    b = fp32(pair.b_key, pair.b).view(out_dim, rank, E).permute(2, 0, 1)   # [E, out, r]
    if proj == "down":
        return {"experts.down_proj": (a, b.contiguous(), scaling)}
    return {"experts.gate_proj": (a, b[:, :I].contiguous(), scaling),
            "experts.up_proj": (a.clone(), b[:, I:].contiguous(), scaling)}


def _stack(name: str, layer: int, module: str, experts: dict, settings, spec, max_lora_rank: int, fp32: Callable):
    first = next(iter(experts.values()))
    _check_layer(name, layer, repr(first.a_key), spec)
    E = spec.num_experts
    in_dim, out_dim = spec.module_dims[module]
    bad = sorted(e for e in experts if e >= E)
    if bad:
        raise AdapterTargetError(f"adapter {name!r}: layer {layer} {module} names experts {bad}; the model has {E}")
    scaled = {}
    for e, pair in experts.items():
        rank, scaling = settings.rank_and_scaling(pair.module_path)
        _check_rank(name, pair.module_path, rank, max_lora_rank)
        for key, tensor, want in ((pair.a_key, pair.a, [rank, in_dim]), (pair.b_key, pair.b, [out_dim, rank])):
            if list(tensor.shape) != want:
                raise AdapterShapeError(f"adapter {name!r}: tensor {key!r} has shape {list(tensor.shape)}, expected "
                                        f"{want} (rank {rank}, {module} dims {in_dim} -> {out_dim})")
        scaled[e] = (fp32(pair.a_key, pair.a), fp32(pair.b_key, pair.b), scaling)
    r = max(a.shape[0] for a, _, _ in scaled.values())
    common = {s for _, _, s in scaled.values()}
    fold = len(common) > 1   # per-expert scalings differ: each folded into its B
    a3, b3 = torch.zeros(E, r, in_dim), torch.zeros(E, out_dim, r)
    for e, (a, b, scaling) in scaled.items():
        a3[e, :a.shape[0]] = a
        b3[e, :, :a.shape[0]] = b * scaling if fold else b
    return a3, b3, 1.0 if fold else common.pop()


def _check_rank(name: str, module_path: str, rank: int, max_lora_rank: int) -> None:
    if not 1 <= rank <= max_lora_rank:
        raise AdapterRankError(f"adapter {name!r}: module {module_path!r} has rank {rank}, expected 1 to "
                               f"max_lora_rank {max_lora_rank}")
