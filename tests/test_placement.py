"""Acceptance (issue 4): worker placement on NPUs, without torch_npu.

The pure functions that build bundles, actor resources and device indices are
checked for every platform; then a loopback Ray with two fake NPUs schedules the
real worker actors (created, not started, so nothing imports torch_npu) in their
own group and inside a caller's (Serve-style) group, and each actor reports the
device Ray gave it.
"""
import sys

import pytest

from serve_fixtures import local_ray
from workers.config import EngineConfig
from workers.device import PLATFORMS
from workers.ray_utils import actor_resources, local_device_index, worker_bundle_indices, worker_bundles

NPU, GPU, CPU = PLATFORMS["npu"], PLATFORMS["cuda"], PLATFORMS["cpu"]


@pytest.mark.own_cluster
def test_engine_side_needs_a_running_ray():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("another module left Ray running")
    from workers.worker_group import WorkerGroup
    with pytest.raises(RuntimeError, match="Ray is not initialised"):
        WorkerGroup(EngineConfig(model="tiny", tensor_parallel_size=2), runtime=None, platform=CPU)
    assert not ray.is_initialized()


def test_bundles_and_actor_resources_per_platform():
    assert worker_bundles(NPU, 2) == [{"NPU": 1}, {"NPU": 1}]
    assert worker_bundles(GPU, 1) == [{"GPU": 1}]
    assert worker_bundles(CPU, 3) == [{"CPU": 1}] * 3
    assert actor_resources(NPU) == {"num_cpus": 0, "resources": {"NPU": 1}}
    assert actor_resources(GPU) == {"num_cpus": 0, "num_gpus": 1}
    assert actor_resources(CPU) == {"num_cpus": 1}
    assert (NPU.visible_devices_env, NPU.dist_backend) == ("ASCEND_RT_VISIBLE_DEVICES", "hccl")


def test_ranks_take_the_last_bundles_of_a_callers_group():
    serve_style = [{"CPU": 1}, {"NPU": 1}, {"NPU": 1}]   # the replica, then one bundle per rank
    assert worker_bundle_indices(serve_style, NPU, 2) == [1, 2]
    assert worker_bundle_indices(serve_style[1:], NPU, 2) == [0, 1]
    with pytest.raises(ValueError, match="lack"):
        worker_bundle_indices([{"NPU": 1}, {"CPU": 1}, {"NPU": 1}], NPU, 2)
    with pytest.raises(ValueError, match="one .* bundle per rank"):
        worker_bundle_indices([{"CPU": 1}, {"NPU": 1}], NPU, 3)


def test_visible_device_mapping():
    assert local_device_index(["3"], "3") == 0          # Ray narrowed visibility to the assigned device
    assert local_device_index(["3"], "1,3,5") == 1      # RAY_EXPERIMENTAL_NOSET_*: position in the visible set
    assert local_device_index(["2"], None) == 2         # nothing narrowed: physical id
    assert local_device_index([], None) == 0            # cpu
    with pytest.raises(RuntimeError, match="visible devices"):
        local_device_index(["4"], "0,1")


@pytest.fixture(scope="module")
def ray_npu():
    """Ray with two fake NPUs (the shared cluster has none: an app with device "auto" would pick them)."""
    with local_ray(num_cpus=1, resources={"NPU": 2}):
        import ray
        yield ray


def _check_placements(placements):
    ids = sorted(p["accelerator_ids"][0] for p in placements)
    assert ids == ["0", "1"], placements                       # one distinct fake NPU per rank
    for p in placements:
        assert len(p["accelerator_ids"]) == 1
        assert p["visible_devices"] == p["accelerator_ids"][0]  # Ray set ASCEND_RT_VISIBLE_DEVICES
        assert p["device_index"] == 0                           # logical index within the visible set
    assert len({p["node_id"] for p in placements}) == 1         # STRICT_PACK: one node


@pytest.mark.own_cluster
def test_npu_workers_in_their_own_group(ray_npu):
    ray = ray_npu
    from ray.util.placement_group import placement_group_table, remove_placement_group

    from workers.worker_group import spawn_workers
    workers, group, owned = spawn_workers(EngineConfig(model="tiny", tensor_parallel_size=2), None, NPU)
    try:
        assert owned
        table = placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK"
        assert list(table["bundles"].values()) == [{"NPU": 1.0}, {"NPU": 1.0}]
        _check_placements(ray.get([w.placement.remote() for w in workers], timeout=60))
    finally:
        for w in workers:
            ray.kill(w)
        remove_placement_group(group)
    assert "torch_npu" not in sys.modules


@pytest.mark.own_cluster
def test_npu_workers_inside_a_callers_group(ray_npu):
    ray = ray_npu
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Replica:  # stands in for a Serve replica in bundle 0 of its deployment's group
        def spawn(self):
            from workers.worker_group import spawn_workers
            workers, _, owned = spawn_workers(EngineConfig(model="tiny", tensor_parallel_size=2), None, NPU)
            placements = ray.get([w.placement.remote() for w in workers], timeout=60)
            return owned, placements, "torch_npu" in sys.modules

    group = placement_group([{"CPU": 1}, {"NPU": 1}, {"NPU": 1}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    replica = Replica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0)).remote()
    try:
        owned, placements, imported_torch_npu = ray.get(replica.spawn.remote(), timeout=60)
        assert not owned and not imported_torch_npu
        _check_placements(placements)
    finally:
        ray.kill(replica)
        remove_placement_group(group)
