"""The Ray settings of a cluster we start (workers/ray_utils.py SERVING_RAY_ENV) reach Serve's processes.

A replica runs at nice 0 (Ray's default 15 lets any nice-0 process of the node preempt the inference), in
Serve's throughput-optimized mode (user code on the replica's event loop, gRPC between deployments), and
with direct ingress off (the HTTP proxy still answers on the configured port) and log lines written as they
are logged.
"""
from __future__ import annotations

import os

import pytest
import requests

from workers.ray_utils import SERVING_RAY_ENV

APP = "raysettings"


@pytest.fixture(scope="module")
def probe(shared_serve):
    from ray import serve

    # Defined here, so that it is pickled by value: a replica cannot import this test module.
    class Probe:
        """Reports, from inside a replica, what Serve's constants and the process priority are."""

        def __call__(self, request=None) -> dict:
            from ray.serve._private import constants

            return {"nice": os.nice(0), "env": {k: os.environ.get(k) for k in SERVING_RAY_ENV},
                    "user_code_in_separate_thread": constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
                    "grpc_between_deployments": constants.RAY_SERVE_USE_GRPC_BY_DEFAULT,
                    "direct_ingress": constants.RAY_SERVE_ENABLE_DIRECT_INGRESS,
                    "log_buffer": constants.RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE}

    probe = serve.deployment(Probe, name="Probe", graceful_shutdown_wait_loop_s=0.5)   # deleted without 2 s waits
    handle = serve.run(probe.bind(), name=APP, route_prefix=f"/{APP}")
    return shared_serve, handle


def test_a_replica_runs_at_nice_0_in_serves_throughput_mode(probe):
    _, handle = probe
    got = handle.remote().result(timeout_s=60)
    assert got["env"] == SERVING_RAY_ENV
    assert got["nice"] == 0
    assert got["user_code_in_separate_thread"] is False and got["grpc_between_deployments"] is True
    assert got["direct_ingress"] is False and got["log_buffer"] == 1   # each log line written when logged


def test_the_http_proxy_still_serves_the_configured_port(probe):
    url, _ = probe
    response = requests.get(f"{url}/{APP}", timeout=30)
    assert response.status_code == 200 and response.json()["nice"] == 0
