"""deployments/k8s/rayservice.yaml (issue 14): the KubeRay RayService serves serve_config.yaml's application on an
Ascend cluster, and its NPU counts agree with the tensor-parallel size."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import yaml

from deployments.config import LLMConfig

ROOT = Path(__file__).resolve().parents[1]
ASCEND_DEVICE = "huawei.com/Ascend910"
# What an Ascend cluster sets differently from the shipped serve_config.yaml (its comment names them).
# the Ascend settings, and placement_timeout_s: null (an autoscaling cluster waits for its NPU pods)
ASCEND_SETTINGS = {"model", "device", "tensor_parallel_size", "max_model_len", "placement_timeout_s"}


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load((ROOT / "deployments/k8s/rayservice.yaml").read_text())


@pytest.fixture(scope="module")
def serve_configs(manifest) -> tuple[dict, dict]:
    """(serve_config.yaml, the RayService's serveConfigV2), both parsed."""
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text()), yaml.safe_load(manifest["spec"]["serveConfigV2"])


def k8s_llm_config(serve_configs) -> LLMConfig:
    [app] = serve_configs[1]["applications"]
    return LLMConfig.model_validate(app["args"])


def worker_group(manifest) -> tuple[dict, dict]:
    [group] = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    [container] = group["template"]["spec"]["containers"]
    return group, container


def test_serve_config_v2_is_serve_config_yamls_application(serve_configs):
    local, k8s = serve_configs
    [local_app], [k8s_app] = local["applications"], k8s["applications"]
    assert {k: v for k, v in k8s_app.items() if k != "args"} == {k: v for k, v in local_app.items() if k != "args"}
    assert k8s["proxy_location"] == local["proxy_location"]
    assert k8s["http_options"] == {**local["http_options"], "host": "0.0.0.0"}   # the Service routes to the pod
    assert set(k8s_app["args"]) - {"placement_timeout_s"} == set(local_app["args"])   # no setting only one has
    assert k8s_app["args"]["placement_timeout_s"] is None
    local_config, k8s_config = LLMConfig.model_validate(local_app["args"]), k8s_llm_config(serve_configs)
    assert k8s_config.model_dump(exclude=ASCEND_SETTINGS) == local_config.model_dump(exclude=ASCEND_SETTINGS)
    assert k8s_config.device == "npu"        # not auto: at deploy time no NPU pod may be up yet
    options = k8s_config.deployment_options()
    assert options["autoscaling_config"] == local_config.deployment_options()["autoscaling_config"]
    assert options["placement_group_strategy"] == "STRICT_PACK"


def test_npu_counts_agree_with_the_tensor_parallel_size(manifest, serve_configs):
    config = k8s_llm_config(serve_configs)
    group, container = worker_group(manifest)
    devices = container["resources"]["limits"][ASCEND_DEVICE]
    assert container["resources"]["requests"][ASCEND_DEVICE] == devices
    npus = json.loads(json.loads(group["rayStartParams"]["resources"]))["NPU"]   # KubeRay's quoted JSON
    assert int(devices) == npus
    # a replica's group (STRICT_PACK) fits in one pod, so its TP ranks never span pods
    bundles = config.placement_group_bundles()
    assert bundles == [{"CPU": config.replica_cpus}] + [{"NPU": 1.0}] * config.tensor_parallel_size
    assert npus % config.tensor_parallel_size == 0
    assert config.replica_cpus * npus // config.tensor_parallel_size <= int(container["resources"]["limits"]["cpu"])
    # the worker group can hold every replica Serve autoscaling may ask for, and none without one
    replicas_per_pod = npus // config.tensor_parallel_size
    assert group["minReplicas"] == 0 <= group["replicas"] <= group["maxReplicas"]
    assert group["maxReplicas"] * replicas_per_pod >= config.autoscaling_config["max_replicas"]


def test_head_has_no_npus_and_autoscaling_is_on(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == ray.__version__            # the autoscaler's image matches the pinned Ray
    head = cluster["headGroupSpec"]
    [container] = head["template"]["spec"]["containers"]
    assert ASCEND_DEVICE not in container["resources"].get("limits", {})
    assert "resources" not in head["rayStartParams"]
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
