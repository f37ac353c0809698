"""The user's serving config (validated at the Serve edge) and what it turns into: EngineConfig, Serve options.

`LLMConfig` is what `serve_config.yaml`'s `args`, the CLI and `build_app` take.
It is resolved once, in `build_app`, into absolute paths and a concrete device;
after that nothing writes to it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from lora.adapter import check_adapter_name
from lora.peft_format import CONFIG_NAME, SAFETENSORS_NAME
from lora.sources import is_hub_id
from workers.config import EngineConfig
from workers.device import PLATFORMS, check_device_resource

DEMO_MODEL = "demo"                 # the embedded default: a tiny deterministic model built locally
ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
API_KEY_ENV = "LORASERVE_API_KEY"   # read when the config is built, if api_key is not given


class LLMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # what to serve
    model: str = DEMO_MODEL                        # local HF directory, Hub id, or "demo"
    served_model_name: str | None = None           # the `model` clients name; default from `model`
    adapters: dict[str, str] = Field(default_factory=dict)   # name -> local dir or Hub id, loaded at start
    # engine
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    tensor_parallel_size: int = Field(1, ge=1)
    # The Ray resource each TP rank (or a TP=1 replica) reserves one of; default the device's (CPU / GPU /
    # NPU). With device: cpu it places CPU-computing workers on nodes that advertise it, e.g. "NPU".
    device_resource: str | None = Field(None, min_length=1)
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = Field(64, ge=1)
    max_loras_per_batch: int = Field(4, ge=1)
    max_loaded_loras: int = Field(16, ge=1)
    max_lora_rank: int = Field(64, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)   # tokens per step; default per device
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    adapter_roots: list[str] = Field(default_factory=list)   # local adapter dirs hot-load may read; empty = any
    # the HTTP edge (README "Security")
    api_key: SecretStr | None = None               # Bearer key for /v1/* and /metrics; default $LORASERVE_API_KEY
    enable_hotload: bool = False                   # /v1/load_lora_adapter and /v1/unload_lora_adapter
    max_request_bytes: int = Field(4 << 20, ge=1024)   # larger request bodies get 413
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)   # any other EngineConfig field
    # Serve
    num_replicas: int | None = Field(None, ge=1)   # fixed count; leave unset with autoscaling_config
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    max_num_models_per_replica: int | None = None  # adapters kept warm per replica; default max_loaded_loras
    replica_cpus: float = Field(1.0, gt=0)
    registry_sync_interval_s: float = Field(0.25, gt=0)   # how fast replicas see hot-load / unload
    # A stream's events ready within this window go to the ingress as one item (deployments/stream_batch.py):
    # several decode steps on an accelerator, less than one on a CPU; it adds at most this to a token's latency
    stream_batch_interval_ms: float = Field(10.0, ge=0, le=1000)
    # A replica that cannot be placed fails the deployment instead of waiting: at once when no node could
    # ever hold it, after this many seconds when the cluster is busy (the CLI). None: wait, e.g. for a
    # cluster autoscaler to add a node (see deployments/placement.py).
    placement_timeout_s: float | None = Field(30.0, gt=0)
    demo_cache_dir: str | None = None              # where "demo" is generated; default .cache/

    @model_validator(mode="before")
    @classmethod
    def _api_key_from_env(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("api_key") is None and os.environ.get(API_KEY_ENV):
            return {**data, "api_key": os.environ[API_KEY_ENV]}
        return data

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name in adapters:
            check_adapter_name(name)
        return adapters

    @field_validator("adapter_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[str]) -> list[str]:
        # replicas do not share the caller's working directory
        return [str(Path(root).expanduser().absolute()) for root in roots]

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")
        return key

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(kwargs) - ENGINE_FIELDS
        if unknown:
            raise ValueError(f"engine_kwargs {sorted(unknown)} are not EngineConfig fields")
        return kwargs

    def model_post_init(self, _context) -> None:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        check_device_resource(self.device, self.device_resource)
        EngineConfig(**self._engine_args())   # fail here, at the edge, on a bad engine setting
        if self.base_model_name in self.adapters:
            raise ValueError(f"adapter name {self.base_model_name!r} is the served base model's name; choose another")

    def startup_warnings(self) -> list[str]:
        if self.enable_hotload and not self.adapter_roots:
            return ["hot-load is enabled without adapter_roots: whoever reaches the API can load any directory "
                    "this server can read; set --adapter-root DIR (adapter_roots) to restrict it"]
        return []

    @property
    def base_model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if self.model == DEMO_MODEL:
            return "loraserve-demo"
        return self.model.rstrip("/").split("/")[-1] if self.model.startswith(("/", ".", "~")) else self.model

    def _engine_args(self) -> dict[str, Any]:
        args = dict(model=self.model, device=self.device, device_resource=self.device_resource,
                    tensor_parallel_size=self.tensor_parallel_size,
                    dtype=self.dtype, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                    max_loras_per_batch=self.max_loras_per_batch, max_loaded_loras=self.max_loaded_loras,
                    max_lora_rank=self.max_lora_rank, adapter_roots=tuple(self.adapter_roots),
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    enable_chunked_prefill=self.enable_chunked_prefill,
                    enable_prefix_caching=self.enable_prefix_caching)
        return {**args, **self.engine_kwargs}

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self._engine_args())

    def replica_engine_config(self) -> EngineConfig:
        """The engine of a replica: `adapter_roots` restrict what callers hot-load, never the configured
        adapters (`adapters`, `--lora`, the demo's), which are the operator's. So the engine, which checks
        every file it reads against its roots, also gets each configured local adapter's directory (and
        where its files' symlinks lead, e.g. a Hub cache snapshot) as a root, and Hub ids when one is
        configured. Callers still get only the hot-load roots: LLMServer.load_adapter checks a hot-load
        source against those before anything reads it (`check_hotload_source`). Run in the replica: the
        paths are the replica's node's."""
        engine = self.engine_config()
        if not engine.adapter_roots:
            return engine   # no roots: any path, for configured and hot-loaded adapters alike
        roots, hub = list(engine.adapter_roots), engine.hub_adapters_allowed
        for source in self.adapters.values():
            if is_hub_id(source):
                hub = True
                continue
            roots.append(os.path.realpath(source))
            for file_name in (CONFIG_NAME, SAFETENSORS_NAME):
                target = os.path.realpath(os.path.join(source, file_name))
                if os.path.dirname(target) not in roots:
                    roots.append(os.path.dirname(target))
        return dataclasses.replace(engine, adapter_roots=tuple(dict.fromkeys(roots)), allow_hub_adapters=hub)

    # ---- Serve options -------------------------------------------------------------------------
    def in_process(self) -> bool:
        """TP=1 runs the model inside the replica process (no worker actor), so the replica holds the device."""
        executor = self.engine_kwargs.get("distributed_executor", "auto")
        return self.tensor_parallel_size == 1 and executor in ("auto", "inproc")

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """Bundle 0 is the replica; then one device bundle per TP rank (the worker group takes the last ones)."""
        resource = self.device_resource or (PLATFORMS[self.device].ray_resource if self.device != "auto" else "CPU")
        replica = {"CPU": self.replica_cpus}
        if self.in_process():
            if resource != "CPU":
                replica[resource] = 1.0
            return [replica]
        return [replica] + [{resource: 1.0} for _ in range(self.tensor_parallel_size)]

    def ray_actor_options(self) -> dict[str, Any]:
        """The replica's own resources: exactly bundle 0."""
        bundle = dict(self.placement_group_bundles()[0])
        options: dict[str, Any] = {"num_cpus": bundle.pop("CPU")}
        if "GPU" in bundle:
            options["num_gpus"] = bundle.pop("GPU")
        if bundle:
            options["resources"] = bundle
        return options

    def deployment_options(self) -> dict[str, Any]:
        # Serve replaces a replica after 3 failed health checks in a row (a dead engine: ~3 periods) and
        # waits graceful_shutdown_wait_loop_s (default 2 s) before it even looks at a stopping replica's
        # requests: both shortened so a failed replica is back, and a stop done, in seconds.
        options: dict[str, Any] = dict(
            max_ongoing_requests=self.max_ongoing_requests, ray_actor_options=self.ray_actor_options(),
            placement_group_bundles=self.placement_group_bundles(), placement_group_strategy="STRICT_PACK",
            health_check_period_s=2, graceful_shutdown_timeout_s=5, graceful_shutdown_wait_loop_s=0.5)
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options

    @property
    def models_per_replica(self) -> int:
        return self.max_num_models_per_replica or self.max_loaded_loras
