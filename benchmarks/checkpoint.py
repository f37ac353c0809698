"""The benchmark checkpoint and adapters, generated locally, deterministic, cached.

A Qwen3-0.6B-shaped random model (hidden 1024, 16 heads of 128, 8 KV heads,
intermediate 3072, tied embeddings) with 8 layers and a 32000-token vocabulary,
written once per dtype; PEFT adapters of rank 16 on all seven projections with
random non-zero B. Nothing is downloaded. Each artefact is written into a temp
directory and renamed, so an interrupted run never leaves a half-written cache.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

DEFAULT_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "bench"


def cache_root() -> Path:
    """Where generated checkpoints and adapters live: $LORASERVE_BENCH_CACHE or .cache/bench/."""
    return Path(os.environ.get("LORASERVE_BENCH_CACHE") or DEFAULT_CACHE)
ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 1024
    num_attention_heads: int = 16
    head_dim: int = 128
    num_key_value_heads: int = 8
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    vocab_size: int = 32000
    max_position_embeddings: int = 4096

    @property
    def tag(self) -> str:
        return f"qwen3-h{self.hidden_size}-l{self.num_hidden_layers}-v{self.vocab_size}"

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each LoRA target module."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def base_params(self) -> dict[str, int]:
        """Parameters read per decode step: decoder layers (linear + norms) and the tied LM head."""
        layer = sum(i * o for i, o in self.module_dims().values()) + 2 * self.hidden_size + 2 * self.head_dim
        return {"layers": self.num_hidden_layers * layer, "lm_head": self.vocab_size * self.hidden_size,
                "final_norm": self.hidden_size}

    def lora_params(self, rank: int) -> int:
        """Parameters of one adapter of `rank` on all seven projections of every layer."""
        return self.num_hidden_layers * sum(rank * (i + o) for i, o in self.module_dims().values())


QWEN3_0_6B_8L = ModelShape()
TINY = ModelShape(hidden_size=64, num_attention_heads=4, head_dim=16, num_key_value_heads=2,
                  intermediate_size=128, num_hidden_layers=2, vocab_size=512, max_position_embeddings=512)


def _publish(build, final: Path) -> Path:
    """Run build(tmp_dir) and atomically move the result to `final` (skipped when present)."""
    if (final / ".complete").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return final


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ids "t<i>": benchmarks feed token ids, this only detokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1} | {f"t{i}": i for i in range(2, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(path)


def build_checkpoint(dtype: str = "bfloat16", shape: ModelShape = QWEN3_0_6B_8L, root: Path | None = None,
                     seed: int = 0) -> Path:
    """The random checkpoint in `dtype`; every dtype holds the same (bf16-representable) values."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    def build(tmp: Path) -> None:
        cfg = Qwen3Config(**{k: v for k, v in asdict(shape).items()}, rms_norm_eps=1e-6, initializer_range=0.02,
                          tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        # Round through bf16 so the fp32 and bf16 checkpoints are the same model.
        model = model.to(torch.bfloat16).to(DTYPES[dtype])
        model.save_pretrained(tmp, safe_serialization=True)
        _write_tokenizer(tmp, shape.vocab_size)

    return _publish(build, (root or cache_root()) / f"{shape.tag}-{dtype}")


def _adapter_tensors(shape: ModelShape, rank: int, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape.num_hidden_layers):
        for module, (in_dim, out_dim) in shape.module_dims().items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            # A like PEFT's kaiming-uniform init; B non-zero (PEFT's default zero B would be a no-op).
            bound = in_dim ** -0.5
            tensors[f"{prefix}.lora_A.weight"] = ((torch.rand(rank, in_dim, generator=gen) * 2 - 1) * bound).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_dim, rank, generator=gen) * 0.02).to(dtype)
    return tensors


def adapter_config(rank: int, alpha: int, base: str) -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
            "target_modules": list(ALL7), "bias": "none", "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "fan_in_fan_out": False, "init_lora_weights": True,
            "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": base}


def build_adapters(count: int, shape: ModelShape = QWEN3_0_6B_8L, rank: int = 16, root: Path | None = None,
                   dtype: str = "bfloat16") -> list[Path]:
    """`count` distinct adapters (adapter i has seed i), written once and reused by later runs."""
    from safetensors.torch import save_file

    base_dir = (root or cache_root()) / f"adapters-{shape.tag}-r{rank}-{dtype}"
    paths = []
    for i in range(count):
        def build(tmp: Path, i=i) -> None:
            save_file(_adapter_tensors(shape, rank, seed=1000 + i, dtype=DTYPES[dtype]),
                      os.fspath(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(adapter_config(rank, 2 * rank, shape.tag), indent=1))
        paths.append(_publish(build, base_dir / f"lora-{i:04d}"))
    return paths


def adapter_disk_bytes(path: Path) -> int:
    return (Path(path) / "adapter_model.safetensors").stat().st_size


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Generate (or reuse) the benchmark checkpoint and adapters.")
    parser.add_argument("--adapters", type=int, default=1000)
    args = parser.parse_args()
    start = time.perf_counter()
    for name in DTYPES:
        print(build_checkpoint(name))
    paths = build_adapters(args.adapters)
    print(f"{len(paths)} adapters in {paths[0].parent} ({adapter_disk_bytes(paths[0]) / 2**20:.1f} MiB each), "
          f"{time.perf_counter() - start:.1f} s")
