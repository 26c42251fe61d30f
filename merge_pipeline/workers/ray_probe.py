"""Is a Ray cluster's head at this address? Asked in seconds, before a merge takes its target's lock.

``ray.init`` at something that is not a Ray head (the dashboard's port, a web server, a port that
accepts and stays silent) waits for many minutes inside Ray's C++ client, prints its warnings to the
terminal and does not act on SIGTERM. So the head is asked first with Ray's own gRPC messages over
grpcio (which Ray ships): the GCS's ``GetClusterId`` for ``HOST:PORT``, the Ray Client server's
``ClusterInfo`` ping for ``ray://HOST:PORT``; anything else answering, or nothing, is one line.
"""

from __future__ import annotations

import os
import socket

from merge_pipeline.errors import MergeError

PROBE_SECONDS = 5

# The statuses a Ray service itself returns to a well-formed call it refuses (a cluster with token
# authentication, a Ray Client proxy that wants its client id): the head is there and speaks Ray.
_REFUSED_BY_RAY = {"UNAUTHENTICATED", "PERMISSION_DENIED", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND"}


def check_ray_head(address: str) -> None:
    """One line naming ``address`` unless a Ray head (or Ray Client server) answers there in seconds.
    ``auto`` is RAY_ADDRESS when set; otherwise Ray finds this machine's node itself."""
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS", "auto")
    client = address.startswith("ray://")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not host or not port.isdigit():
        return  # Ray resolves it (the local node) and says what is wrong
    _connect(address, host.strip("[]"), int(port))
    import grpc

    target = f"{host}:{port}"
    with grpc.insecure_channel(target) as channel:
        try:
            if client:
                from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

                request = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
                ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(request, timeout=PROBE_SECONDS)
            else:
                from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

                request = gcs_service_pb2.GetClusterIdRequest()
                gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(request, timeout=PROBE_SECONDS)
        except grpc.RpcError as exc:
            if exc.code().name not in _REFUSED_BY_RAY:
                what = "a Ray Client server (ray://, port 10001)" if client else "a Ray head's GCS port"
                raise MergeError(
                    None,
                    f"Ray cluster at {address}: not answered as by {what} within {PROBE_SECONDS} s ({_said(exc)}):"
                    " give the address `ray start --head` prints (not the dashboard's port)",
                ) from None


def _connect(address: str, host: str, port: int) -> None:
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        raise MergeError(
            None, f"Ray cluster at {address}: cannot connect ({exc.strerror or exc}); is its head running?"
        ) from None


def _said(exc) -> str:
    """What gRPC made of the answer, in a few words (its details can run over several lines)."""
    detail = " ".join(str(exc.details() or "").split())
    return f"{exc.code().name.lower()}: {detail[:120]}" if detail else exc.code().name.lower()
