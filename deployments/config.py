"""The user's serving config (validated at the Serve edge) and what it turns into: EngineConfig, Serve options.

`LLMConfig` is what `serve_config.yaml`'s `args`, the CLI and `build_app` take.
The engine's settings pass through `engine_kwargs` (as in Ray Serve LLM), checked
and typed by EngineConfig itself (workers/config.py): nothing here re-declares
them. An EngineConfig field written beside `engine_kwargs` (this config's
earlier spelling, `tensor_parallel_size: 8`) is moved into it. The config is
resolved once, in `build_app`, into absolute paths and a concrete device; after
that nothing writes to it.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, TypeAdapter, field_validator, model_validator
from ray.serve.config import RequestRouterConfig

from lora.names import check_adapter_name
from deployments.routing.policy import AffinityPolicy
from lora.sources import CONFIG_NAME, SAFETENSORS_NAME, is_hub_id
from workers.config import EngineConfig
from workers.device import PLATFORMS, check_device_resource

DEMO_MODEL = "demo"                 # the embedded default: a tiny deterministic model built locally
ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}   # `model` is LLMConfig's own
# Where a replica's engine differs from EngineConfig's defaults: it shares its node with Serve (workers/config.py)
REPLICA_ENGINE_DEFAULTS = {"cpu_reserved_cores": 1}
_ENGINE = TypeAdapter(EngineConfig)   # EngineConfig's types and checks, with pydantic's errors naming the field
API_KEY_ENV = "LORASERVE_API_KEY"   # read when the config is built, if api_key is not given


class LLMConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # what to serve
    model: str = DEMO_MODEL                        # local HF directory, Hub id, or "demo"
    served_model_name: str | None = None           # the `model` clients name; default from `model`
    adapters: dict[str, str] = Field(default_factory=dict)   # name -> local dir or Hub id, loaded at start
    # EngineConfig fields (device, tensor_parallel_size, max_model_len, max_num_seqs, the LoRA limits,
    # adapter_roots: local adapter dirs hot-load may read, ...); their defaults are EngineConfig's
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    # the HTTP edge (docs/security.md)
    api_key: SecretStr | None = None               # Bearer key for /v1/*; default $LORASERVE_API_KEY
    # /metrics needs the key too (default: open, as vLLM's, for Prometheus; it shows counts and adapter names)
    metrics_require_api_key: bool = False
    enable_hotload: bool = False                   # /v1/load_lora_adapter and /v1/unload_lora_adapter
    max_request_bytes: int = Field(4 << 20, ge=1024)   # larger request bodies get 413
    # Serve
    num_replicas: int | None = Field(None, ge=1)   # fixed count; leave unset with autoscaling_config
    autoscaling_config: dict[str, Any] | None = None
    max_ongoing_requests: int = Field(64, ge=1)
    max_num_models_per_replica: int | None = None  # adapters kept warm per replica; default max_loaded_loras
    # How requests pick a replica (docs/routing.md): "adapter-affinity" (deployments/routing/: home sets by
    # rendezvous hashing, sized to demand, bounded load) or "multiplex" (Serve's default multiplexed routing)
    routing: Literal["adapter-affinity", "multiplex"] = "adapter-affinity"
    routing_options: dict[str, Any] = Field(default_factory=dict)   # AffinityPolicy's knobs, by name
    routing_stats_period_s: float = Field(1.0, gt=0)   # how often replicas report residency and load
    replica_cpus: float = Field(1.0, gt=0)
    # each replica's heartbeat to the adapter registry (its stats; silent for 4 periods, 3 s at least: gone);
    # hot-load and unload reach every replica at once (a long poll: adapter_mirror.py)
    registry_sync_interval_s: float = Field(1.0, gt=0)
    # A stream's events ready within this window go to the ingress as one item (deployments/render.py `batched`):
    # several decode steps on an accelerator, less than one on a CPU; it adds at most this to a token's latency
    stream_batch_interval_ms: float = Field(10.0, ge=0, le=1000)
    # The engine in a process of its own (workers/engine_process.py, vLLM's EngineCore) when it runs in the
    # replica's process (TP=1): its steps no longer share the GIL with the replica's streaming. False: a thread.
    engine_process: bool = True
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

    @model_validator(mode="before")
    @classmethod
    def _engine_fields_into_engine_kwargs(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not ENGINE_FIELDS & set(data):
            return data
        kwargs = dict(data.get("engine_kwargs") or {})
        for name in ENGINE_FIELDS & set(data):
            if name in kwargs and kwargs[name] != data[name]:
                raise ValueError(f"{name} is given twice, at the top level and in engine_kwargs; keep one")
            kwargs[name] = data[name]
        return {**{k: v for k, v in data.items() if k not in ENGINE_FIELDS}, "engine_kwargs": kwargs}

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and not key.get_secret_value().strip():
            raise ValueError("api_key must not be empty (leave it unset for no authentication)")
        return key

    @field_validator("routing_options")
    @classmethod
    def _routing_options_are_the_policys(cls, options: dict[str, Any]) -> dict[str, Any]:
        try:
            AffinityPolicy(**options)   # the router builds one from these in every caller's process
        except TypeError as e:
            raise ValueError(f"routing_options: {e} (the options are AffinityPolicy's keyword arguments: "
                             "deployments/routing/policy.py)") from None
        return options

    @field_validator("engine_kwargs")
    @classmethod
    def _engine_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = set(kwargs) - ENGINE_FIELDS
        if unknown:
            raise ValueError(f"engine_kwargs {sorted(unknown)} are not EngineConfig fields"
                             + (" (model is a field of this config itself)" if "model" in unknown else ""))
        if kwargs.get("adapter_roots"):   # replicas do not share the caller's working directory
            roots = [str(Path(root).expanduser().absolute()) for root in kwargs["adapter_roots"]]
            kwargs = {**kwargs, "adapter_roots": roots}
        typed = _ENGINE.validate_python({**kwargs, "model": "-"})   # the model is checked in engine_config()
        return {name: getattr(typed, name) for name in kwargs}      # as EngineConfig holds them (tuples, ints)

    def model_post_init(self, _context) -> None:
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        engine = self.engine_config()   # fail here, at the edge, on a bad engine setting
        check_device_resource(engine.device, engine.device_resource)
        for name in self.adapters:
            check_adapter_name(name, self.base_model_name)

    def startup_warnings(self) -> list[str]:
        if self.enable_hotload and not self.engine.adapter_roots:
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

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, **{**REPLICA_ENGINE_DEFAULTS, **self.engine_kwargs})

    @property
    def engine(self) -> EngineConfig:
        """The engine's settings (EngineConfig's defaults for what engine_kwargs leaves out)."""
        return self.engine_config()

    def replica_engine_config(self) -> EngineConfig:
        """The engine of a replica: `adapter_roots` restrict what callers hot-load, never the configured
        adapters (`adapters`, `--lora`, the demo's), which are the operator's. So the engine, which checks
        every file it reads against its roots, also gets each configured local adapter's directory (and
        where its files' symlinks lead, e.g. a Hub cache snapshot) as a root, and Hub ids when one is
        configured. Callers still get only the hot-load roots: LLMServer.load_adapter checks a hot-load
        source against those before anything reads it (`lora.sources.check_source_allowed`). Run in the replica: the
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
        """The model runs inside the replica process (no worker actor), so the replica holds the device."""
        return self.engine.runs_in_process

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """Bundle 0 is the replica; then one device bundle per TP rank (the worker group takes the last ones)."""
        engine = self.engine
        own = PLATFORMS[engine.device].ray_resource if engine.device != "auto" else "CPU"
        resource = engine.device_resource or own
        replica = {"CPU": self.replica_cpus}
        if self.in_process():
            if resource != "CPU":
                replica[resource] = 1.0
            return [replica]
        return [replica] + [{resource: 1.0} for _ in range(engine.tensor_parallel_size)]

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
        if self.routing == "adapter-affinity":
            options["request_router_config"] = RequestRouterConfig(
                request_router_class="deployments.routing.router:AdapterAffinityRouter",
                request_router_kwargs=dict(self.routing_options),
                request_routing_stats_period_s=self.routing_stats_period_s,
                request_routing_stats_timeout_s=max(1.0, 2 * self.routing_stats_period_s))
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options

    @property
    def models_per_replica(self) -> int:
        return self.max_num_models_per_replica or self.engine.max_loaded_loras
