"""Keep Ray Serve's per-replica gRPC server off the wildcard address.

Ray Serve 2.60 starts an inter-deployment gRPC server in every replica on all
interfaces, with no setting to change it: ray/serve/_private/replica.py,
`_on_initialized`: `add_port_to_grpc_server(self._server, "[::]:0")`. Its
handler unpickles request metadata, so on a loopback-only service it must
not be reachable from the network. Callers dial a replica at its node's IP
(`ReplicaInfo.node_ip:port` in ray/serve/_private/request_router/
replica_wrapper.py), so binding that IP instead loses nothing: on a node
started on 127.0.0.1 the server is loopback-only, on a cluster node it
listens on that node's address alone.

Each deployment calls `bind_replica_grpc_to_node_ip()` first thing in its
__init__: Serve starts the server right after __init__ returns, in the same
process, and looks the helper up in the module at call time. Remove this
once Serve takes the address from a setting (tests/test_cli_service.py fails on
any wildcard bind, so a Ray upgrade that changes the line is noticed).
"""
from __future__ import annotations

import ray

WILDCARD = "[::]:"


def bind_replica_grpc_to_node_ip() -> None:
    from ray.serve._private import replica as serve_replica

    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "binds_node_ip", False):
        return   # a Ray without that helper (nothing to fix here), or already done in this process
    ip = ray.util.get_node_ip_address()
    host = f"[{ip}]" if ":" in ip else ip

    def add_port_on_node_ip(server, address: str) -> int:
        if address.startswith(WILDCARD):
            address = f"{host}:{address[len(WILDCARD):]}"
        return original(server, address)   # keeps Ray's TLS handling (RAY_USE_TLS)

    add_port_on_node_ip.binds_node_ip = True
    serve_replica.add_port_to_grpc_server = add_port_on_node_ip
