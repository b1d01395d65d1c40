"""Head <-> headless-node control protocol (multi-node stage deployments).

Transport: one TCP connection per node, `multiprocessing.connection` framing with pickled
messages, opened with its HMAC challenge in both directions (the shared authkey). Pickle means
whoever holds the key can run code on the other side, so the key is the trust boundary:

* `VLLM_OMNI_AUTHKEY` (same value on the head and every node) is the key. Set it in production.
* Without it, both sides derive a key from the pipeline's name and topology. That only stops
  strays (a node of another pipeline); it is not a secret, and the head logs a warning.

Conversation (N = node, H = head):
    N -> H  Register(node, host, pid, stages)   the stages it runs and their status
    H -> N  Welcome(head) | Rejected(reason)
    H -> N  ToStage(stage_id, Submit | Abort)   (vllm_omni_plugin.stages.messages)
    N -> H  Result | Unavailable(request_id)    Unavailable: the node's stage is down (503)
    N -> H  Heartbeat(stages)                   every HEARTBEAT_S; the head answers Ping
    H -> N  Superseded(reason)                  a newer node registered the same stage: exit
Either side declares the other dead on EOF or after DEAD_AFTER_S without a message.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

AUTHKEY_ENV = "VLLM_OMNI_AUTHKEY"
HEARTBEAT_ENV = "VLLM_OMNI_HEARTBEAT_S"

HEARTBEAT_S = float(os.environ.get(HEARTBEAT_ENV, "1.0"))
DEAD_AFTER_S = 5 * HEARTBEAT_S  # missed heartbeats before a peer counts as dead
REGISTER_TIMEOUT_S = 10.0  # a connection must say Register (or Welcome) within this


@dataclass
class StageStatus:
    """One stage on a node, as the node sees it."""

    kind: str
    ready: bool
    info: dict[str, Any] = field(default_factory=dict)  # the stage's Ready info (limits, ...)
    restarts: int = 0
    deaths: int = 0
    pid: int | None = None


@dataclass
class Register:
    node: str  # unique per node process, e.g. "host:pid"
    host: str
    pid: int
    stages: dict[int, StageStatus]


@dataclass
class Welcome:
    head: str


@dataclass
class Rejected:
    reason: str


@dataclass
class Superseded:
    reason: str


@dataclass
class Heartbeat:
    stages: dict[int, StageStatus]


@dataclass
class Ping:
    pass


@dataclass
class ToStage:
    """A Submit or Abort for one of the node's stages."""

    stage_id: int
    msg: Any


@dataclass
class Unavailable:
    """The node could not run the request because its stage is down (HTTP 503)."""

    request_id: str
    message: str


def authkey(cfg: Any) -> bytes:
    """The connection key: $VLLM_OMNI_AUTHKEY, else one derived from the pipeline (see above)."""
    explicit = os.environ.get(AUTHKEY_ENV)
    if explicit:
        return explicit.encode()
    shape = ",".join(f"{s.stage_id}:{s.kind}:{sorted(s.inputs)}" for s in cfg.topology.stages)
    return hashlib.sha256(f"vllm-omni-plugin/{cfg.pipeline}/{shape}".encode()).digest()


def explicit_authkey() -> bool:
    return bool(os.environ.get(AUTHKEY_ENV))


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
