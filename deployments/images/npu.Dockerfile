# The loraserve image for Ascend NPUs (910B / A2 by default): the CANN toolkit, torch 2.13.0 + torch_npu 2.13.0,
# sgl_kernel_npu built from the pinned sgl-kernel-npu tag for one SoC, and this repository (Ray 2.60.0 with it).
# From the checkout's root (the build needs the package index, github.com and gitcode.com for the kernels'
# submodules; it needs no NPU):
#
#   docker build -f deployments/images/npu.Dockerfile -t <registry>/loraserve-ascend:0.1.0 .
#   docker build -f deployments/images/npu.Dockerfile --build-arg CANN_TAG=8.5.0-a3-ubuntu22.04-py3.11 \
#       --build-arg SOC_VERSION=Ascend910_9382 -t <registry>/loraserve-ascend-a3:0.1.0 .     # A3
#
# KubeRay replaces the container's command with its own `ray start`, and a `docker run ... bash -c` skips the
# base image's entrypoint too: everything CANN's set_env.sh exports is image ENV here (below), and the
# entrypoint is cleared, so every process of the container (Ray, its workers, a shell) sees the same
# environment. The driver (/usr/local/Ascend/driver) is the node's: the Ascend device plugin / container
# runtime mounts it into pods that request NPUs. 310P chips: sgl-kernel-npu has no build for them
# (LoRA runs the torch ops there, said once at start-up), use a 310p CANN tag and skip the kernels with
# --build-arg SGL_KERNEL_NPU=skip.

# The CANN base image: <CANN version>-<chip: 910b | a3 | 310p>-<os>-<python>, from quay.io/ascend/cann.
ARG CANN_TAG=8.5.0-910b-ubuntu22.04-py3.11
FROM quay.io/ascend/cann:${CANN_TAG}

ARG TORCH_VERSION=2.13.0
ARG TORCH_NPU_VERSION=2.13.0
# torch_npu runs on torch's CPU build (the CUDA build is only larger), hence its own index for torch alone.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# lora/backends/ascend.py SGL_KERNEL_NPU_VERSION / SGL_KERNEL_NPU_COMMIT (tests/test_k8s_manifest.py checks both).
ARG SGL_KERNEL_NPU_TAG=2026.08.21
ARG SGL_KERNEL_NPU_COMMIT=f425bdf1e191a7682296d3b2ed0b927d4e37d671
# build.sh -a kernels <SoC>: Ascend910B1 for 910B (A2), Ascend910_9382 for A3 (its default when none is named).
ARG SOC_VERSION=Ascend910B1
ARG SGL_KERNEL_NPU=build

# What /usr/local/Ascend/ascend-toolkit/set_env.sh (and nnal/atb's) export, as image ENV.
ENV ASCEND_TOOLKIT_HOME=/usr/local/Ascend/ascend-toolkit/latest
ENV ASCEND_HOME_PATH=${ASCEND_TOOLKIT_HOME} \
    ASCEND_AICPU_PATH=${ASCEND_TOOLKIT_HOME} \
    ASCEND_OPP_PATH=${ASCEND_TOOLKIT_HOME}/opp \
    TOOLCHAIN_HOME=${ASCEND_TOOLKIT_HOME}/toolkit \
    ATB_HOME_PATH=/usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_1
ENV LD_LIBRARY_PATH=/usr/local/Ascend/driver/lib64:/usr/local/Ascend/driver/lib64/common:/usr/local/Ascend/driver/lib64/driver:${ASCEND_TOOLKIT_HOME}/lib64:${ASCEND_TOOLKIT_HOME}/lib64/plugin/opskernel:${ASCEND_TOOLKIT_HOME}/lib64/plugin/nnengine:${ASCEND_TOOLKIT_HOME}/opp/built-in/op_impl/ai_core/tbe/op_tiling:${ASCEND_TOOLKIT_HOME}/tools/aml/lib64:${ASCEND_TOOLKIT_HOME}/tools/aml/lib64/plugin:${ATB_HOME_PATH}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}} \
    PYTHONPATH=${ASCEND_TOOLKIT_HOME}/python/site-packages:${ASCEND_TOOLKIT_HOME}/opp/built-in/op_impl/ai_core/tbe${PYTHONPATH:+:${PYTHONPATH}} \
    PATH=${ASCEND_TOOLKIT_HOME}/bin:${ASCEND_TOOLKIT_HOME}/compiler/ccec_compiler/bin:${ASCEND_TOOLKIT_HOME}/tools/ccec_compiler/bin:${ATB_HOME_PATH}/bin:${PATH}
# Collectives inside captured (ACL) graphs: what vllm-ascend documents for HCCL in graph mode.
ENV HCCL_OP_EXPANSION_MODE=AIV \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch (CPU build) first, then torch_npu for it: pip keeps the torch already there.
RUN python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && python3 -m pip install "torch==${TORCH_VERSION}" "torch_npu==${TORCH_NPU_VERSION}"

# sgl_kernel_npu (not on the package index): built at the pinned tag for one SoC, its wheel installed.
RUN if [ "${SGL_KERNEL_NPU}" = "build" ]; then \
        git clone --branch "${SGL_KERNEL_NPU_TAG}" --depth 1 https://github.com/sgl-project/sgl-kernel-npu /tmp/sgl-kernel-npu \
     && cd /tmp/sgl-kernel-npu \
     && test "$(git rev-parse HEAD)" = "${SGL_KERNEL_NPU_COMMIT}" \
     && git submodule update --init --recursive --depth 1 \
     && bash build.sh -a kernels "${SOC_VERSION}" \
     && python3 -m pip install --no-deps output/sgl_kernel_npu-*.whl \
     && cd / && rm -rf /tmp/sgl-kernel-npu; \
    else echo "sgl_kernel_npu skipped: LoRA runs on the torch ops (lora_backend torch_native)"; fi

# The project: its pins (torch is already the pinned one), then the code.
WORKDIR /opt/loraserve
COPY pyproject.toml README.md ./
COPY lora ./lora
COPY workers ./workers
COPY deployments ./deployments
COPY serve_config.yaml ./
RUN python3 -m pip install "torch==${TORCH_VERSION}" ".[npu]"

# No entrypoint: KubeRay's `ray start` (or any command) runs as given, with the ENV above.
ENTRYPOINT []
CMD ["/bin/bash"]
