"""Ray's token authentication, on for every cluster the project uses, checked before joining.

The API server (the Ray driver) always runs with `RAY_AUTH_MODE=token`: a Ray cluster accepts
work only from processes that hold its token. Where the token comes from:

- `runtime.address: local` (the server starts a private cluster): the token Ray finds
  (`RAY_AUTH_TOKEN`, the file at `RAY_AUTH_TOKEN_PATH`, or `~/.ray/auth_token`); if there is
  none, a fresh random one in a 0600 file of our own (`ray_auth_token` in the user's runtime
  or cache folder, the same place as the node link's key), never `~/.ray`.
- a cluster you started (`address: auto` or `host:port`): that cluster's token, from the same
  sources; start it with `RAY_AUTH_MODE=token ray start --head` (Ray then reads or creates
  `~/.ray/auth_token`; `ray get-auth-token` prints it), and give every node and this server the
  same token.

Before joining, the cluster's head is asked one unauthenticated question: a cluster that
answers it runs without token authentication, and one that refuses our token holds another;
both are refused here with what to do, instead of a confusing `InvalidAuthToken` later.
`RAY_AUTH_MODE=disabled` is refused: the project does not run Ray without authentication.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .private_files import PrivateFileError, shared_secret

logger = logging.getLogger("vllm_omni_plugin.orchestrator.ray")

TOKEN_FILE = "ray_auth_token"
PROBE_TIMEOUT_S = 5.0
START_HINT = (
    "start one with token authentication: `RAY_AUTH_MODE=token ray start --head` on the head "
    "(and `RAY_AUTH_MODE=token ray start --address HEAD:6379` on each other node, with the "
    "same token: `ray get-auth-token` prints it), or set `runtime.address: local` to let the "
    "server start a private cluster"
)


class RayAuthError(RuntimeError):
    """The Ray cluster cannot be joined with token authentication; the message says why."""


def own_token_file() -> Path:
    """Our token file (created with a random token, 0600, if missing)."""
    try:
        return shared_secret(TOKEN_FILE)[1]
    except PrivateFileError as exc:
        raise RayAuthError(str(exc)) from None


def use_token_auth(address: str) -> None:
    """Put this process (and the processes it starts) in token mode with a token, and check
    the cluster at `address` ("local": none yet) agrees. RayAuthError otherwise."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None and mode.lower() != "token":
        raise RayAuthError(
            f"RAY_AUTH_MODE={mode} is set; vllm-omni-plugin runs Ray with token authentication "
            "only (anyone who reaches an unauthenticated cluster can run code in it): unset it "
            "or set RAY_AUTH_MODE=token"
        )
    os.environ["RAY_AUTH_MODE"] = "token"
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")  # Ray caches its mode: read the variable again
    loader = AuthenticationTokenLoader.instance()
    loader.reset_cache()
    if not loader.has_token(ignore_auth_mode=True):
        if address != "local":
            raise RayAuthError(
                f"the Ray cluster at {address} needs its authentication token and none was "
                "found: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to a file holding it, or put "
                "it in ~/.ray/auth_token (`ray get-auth-token` on the head prints it)"
            )
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(own_token_file())
        loader.reset_cache()
        logger.info("Ray token for the local cluster: %s", os.environ["RAY_AUTH_TOKEN_PATH"])
    if address != "local":
        check_cluster(address, loader.get_token_for_http_header())


def check_cluster(address: str, auth_headers: dict[str, str]) -> None:
    """Ask the cluster's head (GCS) for its id without and then with our token."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = gcs_service_pb2.GetClusterIdRequest()
        try:
            stub.GetClusterId(request, timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise RayAuthError(
                    f"cannot reach the Ray cluster at {address} ({exc.code().name}); " + START_HINT
                ) from None
        else:
            raise RayAuthError(
                f"the Ray cluster at {address} runs without token authentication, which "
                "vllm-omni-plugin does not use; stop it (`ray stop`) and " + START_HINT
            )
        metadata = [(k.lower(), v) for k, v in auth_headers.items()]
        try:
            stub.GetClusterId(request, timeout=PROBE_TIMEOUT_S, metadata=metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise RayAuthError(
                    f"the Ray cluster at {address} refuses this server's token: give the server "
                    "the cluster's token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
                    "~/.ray/auth_token; `ray get-auth-token` on the head prints it)"
                ) from None
            raise RayAuthError(f"the Ray cluster at {address}: {exc.code().name}") from None
