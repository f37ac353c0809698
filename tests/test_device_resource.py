"""`device_resource` (issue 14): the Ray resource a worker reserves, separate from the torch device it computes on.

It flows LLMConfig -> EngineConfig -> the replica's placement bundles and the
worker actors' resources; only cpu workers may take another resource than their
device's (Ray hands out GPUs and NPUs through exactly their own). The end-to-end
use, CPU workers on fake NPU nodes of an autoscaling cluster, is
tests/test_cluster_autoscaling.py.
"""
from __future__ import annotations

import pydantic
import pytest

from deployments.config import LLMConfig
from workers.config import EngineConfig
from workers.device import PLATFORMS, get_platform
from workers.ray_utils import actor_resources, worker_bundle_indices, worker_bundles


def test_llm_config_places_cpu_workers_on_npu_bundles():
    config = LLMConfig(model="m", device="cpu", device_resource="NPU", tensor_parallel_size=2)
    assert config.placement_group_bundles() == [{"CPU": 1.0}, {"NPU": 1.0}, {"NPU": 1.0}]
    assert config.ray_actor_options() == {"num_cpus": 1.0}
    engine = config.engine_config()
    assert (engine.device, engine.device_resource) == ("cpu", "NPU")
    # TP=1 runs in the replica process, so the replica itself holds the resource
    single = LLMConfig(model="m", device="cpu", device_resource="NPU")
    assert single.placement_group_bundles() == [{"CPU": 1.0, "NPU": 1.0}]
    assert single.ray_actor_options() == {"num_cpus": 1.0, "resources": {"NPU": 1.0}}


def test_default_is_the_devices_own_resource():
    for device, resource in (("npu", "NPU"), ("cpu", "CPU")):
        config = LLMConfig(model="m", device=device, tensor_parallel_size=2)
        assert config.placement_group_bundles()[1:] == [{resource: 1.0}] * 2
    assert EngineConfig(model="m").device_resource is None
    assert get_platform("cpu") is PLATFORMS["cpu"]


def test_the_engines_workers_ask_for_the_resource():
    platform = get_platform("cpu", "NPU")
    assert (platform.name, platform.dist_backend, platform.ray_resource) == ("cpu", "gloo", "NPU")
    assert platform.torch_device().type == "cpu"
    assert worker_bundles(platform, 2) == [{"NPU": 1.0}, {"NPU": 1.0}]
    assert actor_resources(platform) == {"num_cpus": 0, "resources": {"NPU": 1}}
    serve_style = LLMConfig(model="m", device="cpu", device_resource="NPU", tensor_parallel_size=2)
    assert worker_bundle_indices(serve_style.placement_group_bundles(), platform, 2) == [1, 2]
    assert PLATFORMS["cpu"].ray_resource == "CPU"   # the shared platform is not changed


@pytest.mark.parametrize("device, resource", [("npu", "CPU"), ("npu", "GPU"), ("cuda", "NPU")])
def test_an_accelerator_reserves_its_own_resource(device, resource):
    with pytest.raises(pydantic.ValidationError, match=f"device_resource='{resource}' with device='{device}'"):
        LLMConfig(model="m", device=device, device_resource=resource)
    with pytest.raises(ValueError, match="must reserve"):
        get_platform(device, resource)
    LLMConfig(model="m", device=device, device_resource=PLATFORMS[device].ray_resource)   # naming it is fine


def test_empty_resource_names_are_refused():
    with pytest.raises(pydantic.ValidationError, match="device_resource"):
        LLMConfig(model="m", device="cpu", device_resource="")
    with pytest.raises(ValueError, match="device_resource must be a Ray resource name"):
        EngineConfig(model="m", device_resource="")
