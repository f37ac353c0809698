"""Tiny random Qwen3-MoE checkpoints (both expert layouts) and expert LoRA adapters (both PEFT formats).

Built in a temp dir like tests/factories.py; nothing is downloaded. Sizes are chosen so that no two
expert shapes coincide (hidden 64, expert intermediate 24, dense intermediate 96): a format read with
the wrong orientation fails on shapes instead of passing by accident.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from factories import make_tokenizer

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def moe_config(vocab_size: int, **overrides):
    from transformers import Qwen3MoeConfig

    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
               num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
               max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cfg.update(overrides)
    return Qwen3MoeConfig(**cfg)


def make_moe_model(path: Path, seed: int = 0, fused: bool = False, **overrides) -> Path:
    """A tiny random Qwen3-MoE checkpoint: per-expert keys as transformers saves them, or (fused=True) the
    fused in-memory layout `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = make_tokenizer(path)
    cfg = moe_config(len(tok), **overrides)
    cfg.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():   # the router's init is zeros: random, so that routing differs per token
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(std=0.5)
    if fused:
        cfg.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
    else:
        model.save_pretrained(path, safe_serialization=True)
    return path


def make_expert_adapter(model_path: Path, out: Path, *, r: int = 4, alpha: int = 8, target_modules=(),
                        seed: int = 0, parameters=tuple(EXPERT_PARAMETERS), **lora_kwargs) -> Path:
    """A PEFT 0.21 adapter with `target_parameters` on every sparse layer's fused experts (+ target_modules)."""
    from factories import make_adapter

    return make_adapter(model_path, out, r=r, alpha=alpha, target_modules=list(target_modules), seed=seed,
                        target_parameters=list(parameters), **lora_kwargs)


def write_per_expert_adapter(model_path: Path, out: Path, *, r: int = 4, alpha: int = 8, seed: int = 0,
                             layers: tuple[int, ...] | None = None) -> tuple[Path, dict]:
    """An adapter in the per-expert 2-D format (transformers 4.x trained, vLLM's default): keys
    `...mlp.experts.E.{gate,up,down}_proj.lora_A/B.weight`, gate and up with their own A.
    Returns (path, {(layer, expert, proj): (A, B)}) for a plain-torch reference."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    sparse = [i for i in range(cfg["num_hidden_layers"]) if i not in cfg["mlp_only_layers"]
              and (i + 1) % cfg["decoder_sparse_step"] == 0]
    gen = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    for layer in (sparse if layers is None else layers):
        for e in range(E):
            for proj, (i, o) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
                a, b = torch.randn(r, i, generator=gen) * 0.1, torch.randn(o, r, generator=gen) * 0.1
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.{proj}"
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
                pairs[layer, e, proj] = (a, b)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["gate_proj", "up_proj", "down_proj"],
        "bias": "none", "lora_dropout": 0.0, "use_rslora": False}))
    return out, pairs


class PerAdapterOracle:
    """HF + PEFT with one PeftModel per adapter: PEFT refuses a second adapter whose target_parameters differ
    from the first's (an attention-only adapter has none), so they cannot share one model."""

    def __init__(self, model_path: Path, adapters: dict[str, Path]):
        from lora_fixtures import PeftOracle

        self.oracles = {name: PeftOracle(model_path, {name: path}) for name, path in adapters.items()}

    def greedy(self, prompt: str, adapter: str | None, max_tokens: int) -> tuple[list[int], list[float]]:
        oracle = self.oracles[adapter] if adapter is not None else next(iter(self.oracles.values()))
        return oracle.greedy(prompt, adapter, max_tokens)


def write_dense_mlp_adapter(model_path: Path, out: Path, *, layers: tuple[int, ...], r: int = 8, alpha: int = 16,
                            seed: int = 0) -> Path:
    """LoRA on the dense MLP (gate/up/down_proj) of `layers`, written by hand: PEFT 0.21 turns the target_modules
    gate/up/down_proj of a Qwen3-MoE model into expert target_parameters, dense layers included."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for proj, (i, o) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
            key = f"base_model.model.model.layers.{layer}.mlp.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, i, generator=gen) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=gen) * 0.1
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none", "lora_dropout": 0.0,
        "target_modules": [f"model.layers.{i}.mlp.{p}" for i in layers for p in ("gate_proj", "up_proj", "down_proj")]}))
    return out


class MergedOracle:
    """Plain torch: the HF model with an adapter's deltas merged into its weights (s * B @ A), for the formats PEFT
    0.21 cannot load into a transformers 5 Qwen3-MoE as they are (per-expert 2-D keys, dense-layer MLPs)."""

    def __init__(self, model_path: Path, adapter: Path):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        config = json.loads((Path(adapter) / "adapter_config.json").read_text())
        scaling = config["lora_alpha"] / config["r"]
        tensors = load_file(Path(adapter) / "adapter_model.safetensors")
        with torch.no_grad():
            for key, a in tensors.items():
                if not key.endswith("lora_A.weight"):
                    continue
                path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                delta = scaling * tensors[key.replace("lora_A", "lora_B")] @ a
                parts = path.split(".")
                if parts[-3] == "experts":   # model.layers.N.mlp.experts.E.proj
                    experts = self.model.get_submodule(".".join(parts[:-2]))
                    e, proj = int(parts[-2]), parts[-1]
                    I = experts.down_proj.shape[-1]
                    if proj == "down_proj":
                        experts.down_proj[e] += delta
                    else:
                        experts.gate_up_proj[e, (proj == "up_proj") * I:(1 + (proj == "up_proj")) * I] += delta
                else:
                    self.model.get_submodule(path).weight += delta

    @torch.inference_mode()
    def greedy(self, prompt: str, adapter, max_tokens: int) -> tuple[list[int], list[float]]:
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        out = self.model.generate(input_ids=ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]


def expert_slot_pool(shape: tuple[int, int, int, int], ranks: tuple[int, ...], *, dtype=torch.float32,
                     scale: float = 0.3, seed: int = 0):
    """A SlotPool of the expert groups (E experts, hidden H, intermediate I, slot rank R = `shape`) with one
    random expert adapter per slot, of the given ranks (below R: zero rows past theirs)."""
    from lora.adapter import LoRAAdapter, LoRAWeights
    from lora.slots import GroupShape, SlotPool

    E, H, I, R = shape
    groups = {"experts_gate_up": GroupShape(H, (I, I), (0,), E), "experts_down": GroupShape(I, (H,), (0,), E)}
    pool = SlotPool(1, groups, len(ranks), R, dtype, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for slot, rank in enumerate(ranks):
        weights = {(0, m): LoRAWeights(torch.randn(E, rank, i, generator=gen) * scale,
                                       torch.randn(E, o, rank, generator=gen) * scale, 1.5)
                   for m, (i, o) in {"experts.gate_proj": (H, I), "experts.up_proj": (H, I),
                                     "experts.down_proj": (I, H)}.items()}
        pool.load(slot, LoRAAdapter(f"a{slot}", "src", rank, frozenset(m for _, m in weights), weights), slot)
    return pool
