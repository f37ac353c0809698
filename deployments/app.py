"""`build_app(args)`: the Serve application (OpenAI ingress -> LLMServer), named by serve_config.yaml.

Used by `serve run serve_config.yaml`, `serve deploy serve_config.yaml` and the
CLI. The config is resolved here, once: the demo model is generated, local
paths become absolute (replicas do not share the caller's working directory)
and `device: auto` becomes the cluster's device. A replica that no node of the
cluster can hold fails here (deployments/placement.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from deployments.config import DEMO_MODEL, LLMConfig
from deployments.demo_model import ensure_demo
from deployments.llm_server import LLMServer
from deployments.openai_api import OpenAIIngress
from deployments.placement import check_placement

INGRESS_MAX_ONGOING = 1024


def build_app(args: dict[str, Any] | LLMConfig | None = None) -> Application:
    config = resolve(args if isinstance(args, LLMConfig) else LLMConfig.model_validate(args or {}))
    check_placement(config)   # a replica no node can hold fails the deployment now, not never
    server = serve.deployment(LLMServer, name="LLMServer", **config.deployment_options())
    # The ingress only parses JSON and relays: no CPU reservation, and no request limit of its own (the
    # LLMServer's max_ongoing_requests is the back-pressure; requests queued for it drive its autoscaling).
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress", num_replicas=1,
                               max_ongoing_requests=INGRESS_MAX_ONGOING, ray_actor_options={"num_cpus": 0},
                               graceful_shutdown_timeout_s=5, graceful_shutdown_wait_loop_s=0.5)
    return ingress.bind(server.bind(config), config)


def resolve(config: LLMConfig) -> LLMConfig:
    update: dict[str, Any] = {"served_model_name": config.base_model_name}
    if config.model == DEMO_MODEL:
        model, demo_adapters = ensure_demo(config.demo_cache_dir)
        update["model"] = str(model)
        update["adapters"] = {**demo_adapters, **config.adapters}
    else:
        update["model"] = _absolute(config.model)
        update["adapters"] = {name: _absolute(src) for name, src in config.adapters.items()}
    if config.engine.device == "auto":
        update["engine_kwargs"] = {**config.engine_kwargs, "device": detect_device()}
    return config.model_copy(update=update)


def _absolute(source: str) -> str:
    """An existing local path, made absolute; anything else (a Hub id) unchanged."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.exists() or source.startswith((".", "/", "~")) else source


def detect_device() -> str:
    """The device the replicas will find: the cluster's accelerators if Ray is up, else this machine's."""
    if ray.is_initialized():
        resources = ray.cluster_resources()
        return "npu" if resources.get("NPU") else "cuda" if resources.get("GPU") else "cpu"
    from workers.device import get_platform
    return get_platform("auto").name
