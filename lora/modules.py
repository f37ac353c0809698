"""The model's LoRA target modules and how the model packs them: the one definition.

The Llama-family decoder fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, while
checkpoints and PEFT adapters name the unfused modules. Everything that maps one onto the
other reads this table: the model (`LlamaForCausalLM.packed_modules_mapping`, vLLM's name)
and its checkpoint loader, the runner's slot shapes and tensor-parallel cuts, the slot pool,
the LoRA layers, adapter validation and the engine config's list of targets.

It lives here, and the model imports it, because lora/ imports nothing from workers/ while
most of its readers are in lora/ (slot pool, layers, adapter validation) or sit behind
signatures other code calls (`model_spec_from_hf_config(cfg_dict, modules)`): passing it as
data would thread one constant through every one of those constructors.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PackedModule:
    """One module of the model that LoRA wraps: one slot-pool group."""
    name: str                   # the model's module, e.g. qkv_proj
    modules: tuple[str, ...]    # the checkpoint / PEFT modules stacked in its output, in order
    path: str | None            # its attribute under each decoder layer; None: one for the model
    parallel: str               # column | row | embedding | lm_head | expert_column | expert_row: how TP
                                # cuts it and its LoRA (expert_*: every expert of a MoE block, per-expert weights)


PACKED_MODULES = (
    PackedModule("qkv_proj", ("q_proj", "k_proj", "v_proj"), "self_attn.qkv_proj", "column"),
    PackedModule("o_proj", ("o_proj",), "self_attn.o_proj", "row"),
    PackedModule("gate_up_proj", ("gate_proj", "up_proj"), "mlp.gate_up_proj", "column"),
    PackedModule("down_proj", ("down_proj",), "mlp.down_proj", "row"),
    PackedModule("embed_tokens", ("embed_tokens",), None, "embedding"),
    PackedModule("lm_head", ("lm_head",), None, "lm_head"),
    # Qwen3-MoE's sparse layers: gate/up/down of every expert (lora/expert_format.py reads both PEFT formats)
    PackedModule("experts_gate_up", ("experts.gate_proj", "experts.up_proj"), "mlp.experts.gate_up_proj",
                 "expert_column"),
    PackedModule("experts_down", ("experts.down_proj",), "mlp.experts.down_proj", "expert_row"),
)
GROUPS = {group.name: group for group in PACKED_MODULES}
# module -> (its group, its slice in the group's stacked output)
MODULE_GROUPS = {module: (group.name, s) for group in PACKED_MODULES for s, module in enumerate(group.modules)}
SUPPORTED_MODULES = tuple(MODULE_GROUPS)
# Whole-model modules: their weights and buffers are stored under layer index -1.
GLOBAL_MODULES = tuple(m for group in PACKED_MODULES if group.path is None for m in group.modules)
LINEAR_MODULES = tuple(m for group in PACKED_MODULES if group.path is not None
                       and not group.parallel.startswith("expert") for m in group.modules)
EXPERT_GROUPS = tuple(group.name for group in PACKED_MODULES if group.parallel.startswith("expert"))
EXPERT_MODULES = tuple(m for name in EXPERT_GROUPS for m in GROUPS[name].modules)
# vLLM's form: fused module -> the checkpoint modules in it, for the fused linear ones only
PACKED_MODULES_MAPPING = {group.name: list(group.modules) for group in PACKED_MODULES
                          if len(group.modules) > 1 and group.name not in EXPERT_GROUPS}
