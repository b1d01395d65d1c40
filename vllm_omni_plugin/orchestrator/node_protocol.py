"""Head <-> headless-node protocol: its constants, the shared key, the node's stage ids.

Transport (link.py): one TCP connection per node. Both sides first prove they hold the shared
key (an HMAC-SHA256 challenge in each direction); after that, length-prefixed frames each hold
one msgpack message of the project's one message schema (common/messages.py, the LINK union:
Register, Heartbeat, ToStage, Result, Progress, ...), the same structs a local stage's socket
carries, and a MAC under a session key of this connection (from the key and both sides'
nonces): a frame altered, injected or replayed on the way closes the link. Decoding builds only those structs and plain data, never an arbitrary object, so a
peer, even one holding the key, cannot make the other side run code. No pickle on this link.

The key:
* `VLLM_OMNI_AUTHKEY` (same value on the head and every node). Required whenever the registry
  listens on, or a node connects to, an address that is not loopback; start-up refuses otherwise.
  It must be at least 32 bytes (node_key.py).
* On loopback only, without it, a random key in a file only this user can read (0600, in the
  user's runtime or cache folder), created by the head or node that starts first and read by
  the others on this host: another local user cannot join.

Payloads never ride this link: a Submit/Result carries a connector descriptor (the consumer
pulls the payload over NIXL/shm), the final stage's encoded images (bytes), or, for an edge
without a connector, an inline tensor as explicit dtype/shape/bytes (common/payload.py).
Either side declares the other dead on EOF or after DEAD_AFTER_S without a message.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any, Literal

from .node_key import AUTHKEY_ENV, explicit_key, same_host_key

HEARTBEAT_ENV = "VLLM_OMNI_HEARTBEAT_S"

HEARTBEAT_S = float(os.environ.get(HEARTBEAT_ENV, "1.0"))
DEAD_AFTER_S = 5 * HEARTBEAT_S  # missed heartbeats before a peer counts as dead
# A registration for a stage a live node holds waits this long: if that node sends nothing
# meanwhile (it heartbeats every HEARTBEAT_S), the newcomer takes the stage, else it is refused.
TAKEOVER_PROBE_S = 3 * HEARTBEAT_S
REGISTER_TIMEOUT_S = 10.0  # a node waits this long for the head's Welcome
# The head gives a connection this long for the whole handshake, its Register included: one
# deadline, not one per read, so trickling a byte at a time cannot hold a slot any longer.
HANDSHAKE_DEADLINE_S = 5.0
DEFAULT_BIND = "127.0.0.1"  # the registry listens on loopback unless told otherwise


# ---- the key -------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    """True when every address `host` resolves to is a loopback address (127/8, ::1).

    "0.0.0.0", "::" and "" mean every interface: not loopback. A name that does not resolve
    is treated as not loopback (the safe answer)."""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    addrs = {info[4][0].split("%", 1)[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


def explicit_authkey() -> bool:
    return bool(os.environ.get(AUTHKEY_ENV))


def authkey(cfg: Any, host: str, role: Literal["head", "node"]) -> bytes:
    """The connection key (node_key.py): $VLLM_OMNI_AUTHKEY (at least 32 bytes); on loopback
    only, else this user's random same-host key. SystemExit naming the variable when `host` is
    not loopback, or the key is too short."""
    explicit = explicit_key()
    if explicit is not None:
        return explicit
    require_explicit_key(host, role)
    return same_host_key()


def require_explicit_key(host: str, role: Literal["head", "node"]) -> None:
    """SystemExit naming VLLM_OMNI_AUTHKEY when it is unset and `host` is not loopback."""
    if explicit_authkey() or is_loopback(host):
        return
    if role == "head":
        what = f"the node registry would listen on {host!r}, which is not a loopback address"
        fix = (
            f"or drop --omni-master-address to listen on {DEFAULT_BIND} only (nodes on this "
            "host alone)"
        )
    else:
        what = f"--omni-master-address {host!r} (the head) is not a loopback address"
        fix = "the value the head was started with"
    raise SystemExit(
        f"{what}, and {AUTHKEY_ENV} is not set. Without it anyone who can reach the port "
        f"could pose as a node or head. Set {AUTHKEY_ENV} to a secret shared by the head and "
        f"every node (e.g. `export {AUTHKEY_ENV}=$(openssl rand -hex 32)`), {fix}."
    )


def parse_stage_ids(value: str | None, cfg: Any) -> list[int]:
    """`--stage-ids "0,2"` -> [0, 2], checked against the pipeline's stages (SystemExit)."""
    known = sorted(s.stage_id for s in cfg.topology.stages)
    if value is None or not str(value).strip():
        return known
    try:
        ids = sorted({int(part) for part in str(value).split(",") if part.strip()})
    except ValueError:
        raise SystemExit(
            f"--stage-ids {value!r}: expected comma-separated stage ids, e.g. '0' or '0,1'"
        ) from None
    unknown = [i for i in ids if i not in known]
    if unknown or not ids:
        raise SystemExit(
            f"--stage-ids {value!r}: pipeline {cfg.pipeline!r} has stages {known}, "
            f"not {unknown or ids}"
        )
    return ids
