"""deployments/k8s/rayservice.yaml (issue 14): the KubeRay RayService serves serve_config.yaml's application on an
Ascend cluster, and its NPU counts agree with the tensor-parallel size. Issue 18: the pods and the image
(deployments/images/npu.Dockerfile) start under KubeRay (CANN's environment as image ENV, not an entrypoint;
/dev/shm; the head without torch_npu), the kernels are the pinned ones, and cluster.yaml builds them."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import ray
import yaml

from deployments.config import LLMConfig
from lora.backends import ascend
from workers.ray_utils import SERVING_RAY_ENV

ROOT = Path(__file__).resolve().parents[1]
ASCEND_DEVICE = "huawei.com/Ascend910"   # Ascend's device plugin; HAMi: huawei.com/Ascend910B, ...Ascend910B3
DOCKERFILE = ROOT / "deployments/images/npu.Dockerfile"
# What CANN's set_env.sh exports that torch_npu, HCCL and the kernels' loader read.
CANN_ENV = {"ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "ASCEND_OPP_PATH", "ASCEND_AICPU_PATH", "LD_LIBRARY_PATH",
            "PATH", "PYTHONPATH"}
# What an Ascend cluster sets differently from the shipped serve_config.yaml (its comment names them).
# the Ascend settings, and placement_timeout_s: null (an autoscaling cluster waits for its NPU pods)
ASCEND_SETTINGS = {"model": True, "placement_timeout_s": True,
                   "engine_kwargs": {"device", "tensor_parallel_size", "max_model_len"}}


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
    assert k8s_config.engine.device == "npu"        # not auto: at deploy time no NPU pod may be up yet
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
    assert bundles == [{"CPU": config.replica_cpus}] + [{"NPU": 1.0}] * config.engine.tensor_parallel_size
    assert npus % config.engine.tensor_parallel_size == 0
    tp = config.engine.tensor_parallel_size
    assert config.replica_cpus * npus // tp <= int(container["resources"]["limits"]["cpu"])
    # the worker group can hold every replica Serve autoscaling may ask for, and none without one
    replicas_per_pod = npus // config.engine.tensor_parallel_size
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


def containers(manifest) -> dict[str, tuple[dict, dict]]:
    """container name -> (container, its pod spec), head and workers."""
    cluster = manifest["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    return {c["name"]: (c, pod) for pod in pods for c in pod["containers"]}


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the NPU image's Dockerfile, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.M)]


def env_of(instructions) -> dict[str, str]:
    env = {}
    for op, args in instructions:
        if op == "ENV":
            env.update(re.findall(r"(\w+)=(\S+)", args))
    return env


def args_of(instructions) -> dict[str, str]:
    return dict(re.match(r"(\w+)=(\S+)", args).groups() for op, args in instructions if op == "ARG" and "=" in args)


def test_every_pod_mounts_a_memory_backed_dev_shm(manifest):
    for name, (container, pod) in containers(manifest).items():
        [mount] = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        [volume] = [v for v in pod.get("volumes", []) if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory", name


def test_the_head_does_not_autoload_torch_npu(manifest):
    head = containers(manifest)["ray-head"][0]
    assert {"name": "TORCH_DEVICE_BACKEND_AUTOLOAD", "value": "0"} in head["env"]
    worker = containers(manifest)["ray-worker"][0]   # the workers hold NPUs: torch_npu is theirs to load
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD" not in {e["name"] for e in worker.get("env", [])}


def test_every_ray_node_starts_with_the_serving_ray_settings(manifest):
    """workers/ray_utils.py SERVING_RAY_ENV: replicas at nice 0, Serve's throughput mode through the proxy."""
    for name, (container, _) in containers(manifest).items():
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert env.items() >= SERVING_RAY_ENV.items(), name
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    for start in (config["head_start_ray_commands"][-1], config["worker_start_ray_commands"][-1]):
        exports = start.split("ray start")[0]
        assert all(f"{key}={value}" in exports.split() for key, value in SERVING_RAY_ENV.items()), start


def test_the_npu_resource_name_is_the_documented_device_plugin_value(manifest):
    _, container = worker_group(manifest)
    names = {k for k in container["resources"]["limits"] if "/" in k}
    assert names == {ASCEND_DEVICE} == {k for k in container["resources"]["requests"] if "/" in k}
    header = (ROOT / "deployments/k8s/rayservice.yaml").read_text().split("apiVersion:")[0]
    readme = (ROOT / "docs" / "deployment.md").read_text()
    for text in (header, readme):   # the value to change, and the HAMi names, are written down
        assert "huawei.com/Ascend910" in text and "huawei.com/Ascend910B" in text and "HAMi" in text


def test_no_container_relies_on_a_command_to_set_up_cann(manifest):
    """KubeRay replaces the command with its `ray start`: an entrypoint or command sourcing set_env.sh never runs."""
    for name, (container, _) in containers(manifest).items():
        assert "set_env.sh" not in json.dumps([container.get("command"), container.get("args")]), name
        assert container["image"] == containers(manifest)["ray-head"][0]["image"]   # one image, built below


def test_the_image_sets_cann_s_environment_as_env_not_in_an_entrypoint():
    instructions = dockerfile()
    env = env_of(instructions)
    assert CANN_ENV <= set(env)
    assert env["ASCEND_TOOLKIT_HOME"] == "/usr/local/Ascend/ascend-toolkit/latest"
    assert env["ASCEND_OPP_PATH"] == "${ASCEND_TOOLKIT_HOME}/opp"
    libs = env["LD_LIBRARY_PATH"].split(":")
    assert {"/usr/local/Ascend/driver/lib64/driver", "${ASCEND_TOOLKIT_HOME}/lib64"} <= set(libs)   # libhccl.so
    assert env["PATH"].endswith("${PATH}") and "${ASCEND_TOOLKIT_HOME}/bin" in env["PATH"]
    for op, args in instructions:   # nothing sources set_env.sh at run time; the base image's entrypoint is gone
        if op in ("ENTRYPOINT", "CMD"):
            assert "set_env" not in args and "source" not in args, (op, args)
    assert ("ENTRYPOINT", "[]") in instructions
    [base] = [args for op, args in instructions if op == "FROM"]
    assert base == "quay.io/ascend/cann:${CANN_TAG}"
    assert re.fullmatch(r"[\w.]+-910b-ubuntu22\.04-py3\.11", args_of(instructions)["CANN_TAG"])


def test_the_image_installs_the_pinned_torch_torch_npu_and_kernels():
    instructions = dockerfile()
    args = args_of(instructions)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch=={args['TORCH_VERSION']}" in project["dependencies"]
    assert f"torch_npu=={args['TORCH_NPU_VERSION']}" in project["optional-dependencies"]["npu"]
    assert args["SGL_KERNEL_NPU_TAG"] == ascend.SGL_KERNEL_NPU_VERSION == "2026.08.21"
    assert args["SGL_KERNEL_NPU_COMMIT"].startswith(ascend.SGL_KERNEL_NPU_COMMIT)
    assert args["SOC_VERSION"] == "Ascend910B1"   # build.sh's own default is an A3 SoC
    runs = " ".join(a for op, a in instructions if op == "RUN")
    assert 'build.sh -a kernels "${SOC_VERSION}"' in runs and "sgl_kernel_npu-*.whl" in runs
    assert '--branch "${SGL_KERNEL_NPU_TAG}"' in runs and '"${SGL_KERNEL_NPU_COMMIT}"' in runs
    assert '".[npu]"' in runs


def test_cluster_yaml_builds_the_pinned_kernels_or_starts_without_them():
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    [install, kernels] = config["setup_commands"]
    assert "'.[npu]'" in install
    assert f"--branch {ascend.SGL_KERNEL_NPU_VERSION} " in kernels and ascend.SGL_KERNEL_NPU_COMMIT in kernels
    assert "build.sh -a kernels Ascend910B1" in kernels and "sgl_kernel_npu-*.whl" in kernels
    # a failed build is said and does not fail the node's setup (LoRA then runs on the torch ops)
    assert kernels.startswith("(") and re.search(r"\)\s*\|\| echo ", kernels)


def test_one_kernel_version_everywhere():
    for path in ("docs/deployment.md", "pyproject.toml", "cluster.yaml", "deployments/k8s/rayservice.yaml",
                 "deployments/images/npu.Dockerfile", "lora/backends/ascend.py"):
        text = (ROOT / path).read_text()
        assert "2026.9.0" not in text, path
    for path in ("docs/deployment.md", "pyproject.toml"):
        assert f"sgl-kernel-npu {ascend.SGL_KERNEL_NPU_VERSION}" in (ROOT / path).read_text(), path
