"""The engine's configuration (frozen) and per-request sampling parameters."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from lora.backend_names import BACKENDS as LORA_BACKENDS
from lora.modules import SUPPORTED_MODULES as SUPPORTED_LORA_MODULES
from workers.device import PLATFORMS
from workers.grammar import StructuredSpec
from workers.reasoning import REASONING_PARSERS
DTYPES = ("auto", "float32", "bfloat16", "float16")
GREEDY_BELOW = 1e-5      # temperatures under this sample greedily (vLLM's rule): 1/T would overflow to NaN
MAX_STOP_STRINGS = 16    # each one is searched for after every token
MAX_STOP_LENGTH = 256    # characters; also what streaming holds back
MAX_LOGPROBS = 20        # alternatives per token (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 300     # entries (OpenAI's bound); each request's bias sits in a fixed device buffer


@dataclass(frozen=True)
class EngineConfig:
    model: str                                  # local HF directory or Hub id
    dtype: str = "auto"                         # auto: the checkpoint's (16-bit: bf16; CPU: with bf16 instructions)
    device: str = "auto"                        # auto | cpu | cuda | npu
    tensor_parallel_size: int = 1
    distributed_executor: str = "auto"          # auto (in-process when TP=1) | inproc | ray
    device_resource: str | None = None          # Ray resource a worker reserves one of; default the device's
    seed: int = 0
    # scheduling
    max_num_seqs: int = 64
    max_model_len: int | None = None            # default: min(model's max positions, 4096)
    max_num_batched_tokens: int | None = None   # tokens per step; default per device (device.py), docs/scheduling.md
    enable_chunked_prefill: bool = True         # long prompts run in chunks beside the decodes
    enable_prefix_caching: bool = True          # reuse the KV of full blocks of a prompt seen before
    # a thinking model's reasoning tags (workers/reasoning.py, vLLM's --reasoning-parser): a request's grammar
    # applies after the reasoning; responses show it apart from the answer (deployments/reasoning.py)
    reasoning_parser: str | None = None
    # KV cache
    kv_block_size: int = 16
    num_kv_blocks: int | None = None            # default: sized by kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    # LoRA
    enable_lora: bool = True
    max_loras_per_batch: int = 8                # measured: 8 adapters at 8 req/s, RESULTS.md "Admission under the LoRA budget"
    max_loaded_loras: int = 16
    max_lora_rank: int = 64
    lora_target_modules: tuple[str, ...] = SUPPORTED_LORA_MODULES
    lora_backend: str | None = None             # torch_native / cpu / ascend; default: the device's (lora.backends)
    max_expert_loras: int | None = None         # MoE: adapters with expert weights per batch (their slots are
                                                # large); None = max_loras_per_batch
    expert_lora_memory_gb: float | None = None  # MoE: room for the expert LoRA slots; None = the device's free memory
    adapter_roots: tuple[str, ...] = ()         # allowed local adapter dirs; empty = any
    allow_hub_adapters: bool | None = None      # Hub ids as sources; default: only without adapter_roots
    # steps a request waits on the LoRA budget before the adapter that entered it last is paused for it (that one
    # too holds it at least this long: no slot thrash); workers/lora_budget.py
    lora_max_wait_steps: int = 4
    adapter_load_timeout_s: float = 120.0       # a disk / Hub read of an adapter taking longer fails
    # CPU: linear weights reordered once for oneDNN at load (prepack_linears); None = on for the CPU
    prepack_weights: bool | None = None
    # CPU: compute threads of each rank; None = $LORASERVE_CPU_THREADS, else this process's CPUs / the ranks (in
    # a Ray actor, torch would otherwise keep the OMP_NUM_THREADS=num_cpus Ray sets: 1 for a replica)
    cpu_threads: int | None = None
    # CPU: cores the default `cpu_threads` leaves to what runs beside the engine. A served engine's neighbours
    # (the replica's event loop, Serve's ingress and proxy, on the same node) would otherwise preempt one of
    # its OpenMP threads, and every parallel op then waits for it; vLLM's CPU worker keeps one core for its
    # front end the same way (VLLM_CPU_NUM_OF_RESERVED_CPU). 0 here; a Serve replica's default is 1.
    cpu_reserved_cores: int = 0
    # decode graphs
    enforce_eager: bool = False
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    graph_safe_decode: bool | None = None       # LoRA/attention graph-safe ops in decode; default: when capturing
    # CPU: decode "captured" as an op tape replayed on the static buffers (workers/tape_graph.py), as a device
    # graph would be (width buckets, fallback, no host read): for tests and benchmarks; off = the CPU's kernel
    # programs (workers/cpu_graph.py) where they apply, eager otherwise
    emulate_capture: bool = False

    @property
    def num_expert_loras(self) -> int:
        return self.max_loras_per_batch if self.max_expert_loras is None else self.max_expert_loras

    @property
    def hub_adapters_allowed(self) -> bool:
        """Hub ids bypass adapter_roots (their files live in the HF cache), so roots alone forbid them."""
        return self.allow_hub_adapters if self.allow_hub_adapters is not None else not self.adapter_roots

    @property
    def runs_in_process(self) -> bool:
        """The model runs in the engine's own process (one in-process ModelRunner, no rank actors): TP 1 unless
        Ray is asked for. Then the engine's process holds the device (and may be a process of its own)."""
        return self.tensor_parallel_size == 1 and self.distributed_executor != "ray"

    def __post_init__(self):
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(f"EngineConfig: {msg}")

        need(isinstance(self.model, str) and self.model != "", "model must be a non-empty path or Hub id")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.device in ("auto", *PLATFORMS), f"device must be auto or one of {', '.join(PLATFORMS)}, "
                                                  f"got {self.device!r}")
        need(self.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1")
        need(self.distributed_executor in ("auto", "inproc", "ray"),
             "distributed_executor must be auto, inproc or ray")
        need(self.tensor_parallel_size == 1 or self.distributed_executor != "inproc",
             f"tensor_parallel_size={self.tensor_parallel_size} needs one process per rank; use "
             "distributed_executor='auto' or 'ray'")
        need(self.device_resource is None or (isinstance(self.device_resource, str) and self.device_resource != ""),
             f"device_resource must be a Ray resource name or None, got {self.device_resource!r}")
        need(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        need(self.cpu_threads is None or self.cpu_threads >= 1, "cpu_threads must be >= 1 (or unset)")
        need(self.cpu_reserved_cores >= 0, "cpu_reserved_cores must be >= 0")
        need(self.lora_backend in (None, *LORA_BACKENDS),
             f"lora_backend must be one of {', '.join(LORA_BACKENDS)} (or unset), got {self.lora_backend!r}")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= self.max_num_seqs,
             f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
             f"({self.max_num_seqs}): every running sequence decodes one token a step")
        need(self.kv_block_size >= 1, "kv_block_size must be >= 1")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks must be >= 2")
        need(self.max_loras_per_batch >= 1, "max_loras_per_batch must be >= 1")
        need(self.max_loaded_loras >= self.max_loras_per_batch,
             f"max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras_per_batch "
             f"({self.max_loras_per_batch})")
        need(self.max_lora_rank >= 1, "max_lora_rank must be >= 1")
        need(self.lora_max_wait_steps >= 1, "lora_max_wait_steps must be >= 1")
        need(self.max_expert_loras is None or 1 <= self.max_expert_loras <= self.max_loras_per_batch,
             f"max_expert_loras must be in [1, max_loras_per_batch ({self.max_loras_per_batch})] or unset")
        need(self.expert_lora_memory_gb is None or self.expert_lora_memory_gb >= 0,
             "expert_lora_memory_gb must be >= 0 (or unset)")
        need(self.adapter_load_timeout_s > 0, "adapter_load_timeout_s must be > 0")
        need(self.reasoning_parser in (None, *REASONING_PARSERS),
             f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or unset, got {self.reasoning_parser!r}")
        bad = set(self.lora_target_modules) - set(SUPPORTED_LORA_MODULES)
        need(not bad, f"lora_target_modules {sorted(bad)} not supported; use {SUPPORTED_LORA_MODULES}")
        need(all(b >= 1 for b in self.graph_batch_sizes), "graph_batch_sizes must be positive")
        need(not (self.emulate_capture and self.graph_safe_decode is False),
             "emulate_capture needs the graph-safe decode ops: leave graph_safe_decode unset (or True)")


@dataclass
class SamplingParams:
    max_tokens: int | None = 16                 # None: the rest of the context (`resolved` once the prompt is known)
    temperature: float = 1.0                    # 0 = greedy
    top_k: int = -1                             # -1 / 0 = off
    top_p: float = 1.0
    seed: int | None = None                     # per request: same seed, same samples, whatever the batch
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = True
    top_logprobs: int = 0                       # alternatives (token id, logprob) per sampled token
    prompt_logprobs: int | None = None          # logprobs of the prompt's own tokens, and this many alternatives
    presence_penalty: float = 0.0               # OpenAI's: minus this once a token has appeared in the output
    frequency_penalty: float = 0.0              # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0             # vLLM's / HF's: prompt or output tokens' logits /= (or *=) this
    min_p: float = 0.0                          # drop tokens below min_p x the likeliest token's probability
    min_tokens: int = 0                         # no EOS, stop token or stop string before this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100 .. 100)
    structured: StructuredSpec | None = None    # the output must match this (workers/grammar.py)

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty) != (0.0, 0.0, 1.0)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if max(map(len, self.stop), default=0) > MAX_STOP_LENGTH:
            raise ValueError(f"stop strings must be at most {MAX_STOP_LENGTH} characters")
        self._check_processors()
        if self.structured is not None:
            if not isinstance(self.structured, StructuredSpec):
                raise ValueError(f"structured must be a StructuredSpec, got {type(self.structured).__name__}")
            # a grammar ends only at EOS where it accepts: ignoring EOS or holding it back has no valid output
            if self.ignore_eos or self.min_tokens:
                raise ValueError(f"{'ignore_eos' if self.ignore_eos else 'min_tokens'} cannot be combined with "
                                 f"{self.structured.field} (the constraint ends the output where it is complete)")

    def _check_processors(self) -> None:
        def need(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        def number(name: str, low: float, high: float) -> None:
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                 and low <= value <= high, f"{name} must be a number in [{low}, {high}], got {value!r}")

        def count(name: str, high: int, allow_none: bool = False) -> None:
            value = getattr(self, name)
            need((allow_none and value is None) or (isinstance(value, int) and not isinstance(value, bool)
                                                     and 0 <= value <= high),
                 f"{name} must be an integer in [0, {high}], got {value!r}")

        number("presence_penalty", -2.0, 2.0)
        number("frequency_penalty", -2.0, 2.0)
        number("repetition_penalty", 0.0, 2.0)
        need(self.repetition_penalty > 0, "repetition_penalty must be > 0")
        number("min_p", 0.0, 1.0)
        count("top_logprobs", MAX_LOGPROBS)
        count("prompt_logprobs", MAX_LOGPROBS, allow_none=True)
        if self.max_tokens is not None:   # else when it is known (`resolved`)
            self._check_min_tokens()
        bias = self.logit_bias or {}
        need(len(bias) <= MAX_LOGIT_BIAS, f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        for token, value in bias.items():
            need(isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                 f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and -100 <= value <= 100,
                 f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")

    def _check_min_tokens(self) -> None:
        value = self.min_tokens
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer in [0, {self.max_tokens}], got {value!r}")

    def resolved(self, max_tokens: int) -> SamplingParams:
        """These parameters with max_tokens None (the rest of the context) made `max_tokens`, once the prompt's
        length is known (workers/request.build_request; vLLM's input processor does the same). A copy: the
        caller's stay as given; the one rule that needed the number (min_tokens within it) runs now."""
        params = copy.copy(self)
        params.max_tokens = max_tokens
        params._check_min_tokens()
        return params
