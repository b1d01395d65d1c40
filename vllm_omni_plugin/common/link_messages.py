"""The node link's messages: a headless node's stages, served by the head (orchestrator/link.py,
node.py, remote.py). Tagged msgspec structs in the same encoding as the local stage messages
(messages.py), decoded against the closed union LinkMessage.

Node link (N = node, H = head), after link.py's handshake:
    N -> H  Register(node, host, pid, stages)   the stages it runs and their status
    H -> N  Welcome(head) | Rejected(reason)
    H -> N  ToStage(stage_id, Submit | Abort | Credit | StreamWait)
    N -> H  Result | Unavailable(request_id)    Unavailable: the node's stage is down (503)
    N -> H  Progress | Pulse | StreamWait       relayed from the node's stages as they come
    N -> H  Chunk               H -> N  Credit  a final stage's streamed output (stages/streams.py)
    H -> N  StreamWait                          that output waits on its caller (the stall clock)
    N -> H  Heartbeat(stages)                   every HEARTBEAT_S; the head answers Ping
    H -> N  Superseded(reason)                  a newer node took the stage after this one did
                                                not answer for TAKEOVER_PROBE_S: exit
"""

from __future__ import annotations

import msgspec

from .messages import Abort, Chunk, Credit, Progress, Pulse, Result, StageInfo, StreamWait, Submit


class StageStatus(msgspec.Struct):
    """One stage on a node, as the node sees it."""

    kind: str
    ready: bool
    info: StageInfo | None = None  # what the stage announced when it became ready
    restarts: int = 0
    deaths: int = 0
    pid: int | None = None
    # Where producers on other nodes open streamed edges to this stage (its TCP listener, on
    # the address the node reaches the head from; empty: none).
    edge_address: str = ""


class Register(msgspec.Struct, tag=True):
    node: str  # unique per node process, e.g. "host:pid"
    host: str
    pid: int
    stages: dict[int, StageStatus]


class Welcome(msgspec.Struct, tag=True):
    head: str


class Rejected(msgspec.Struct, tag=True):
    reason: str


class Superseded(msgspec.Struct, tag=True):
    reason: str


class Heartbeat(msgspec.Struct, tag=True):
    stages: dict[int, StageStatus]


class Ping(msgspec.Struct, tag=True):
    pass


class ToStage(msgspec.Struct, tag=True):
    """A Submit, Abort, or for a final stage's streamed output a Credit or a StreamWait (the
    caller has not taken its window of chunks: the stage is not stalled), for one of the node's
    stages. A Submit's streamed-edge tokens travel masked (orchestrator/edge_tokens.py) under
    `token_nonce`."""

    stage_id: int
    msg: Submit | Abort | Credit | StreamWait
    token_nonce: bytes = b""


class Unavailable(msgspec.Struct, tag=True):
    """The node could not run the request because its stage is down (HTTP 503)."""

    request_id: str
    message: str


LinkMessage = (
    Register
    | Welcome
    | Rejected
    | Superseded
    | Heartbeat
    | Ping
    | ToStage
    | Result
    | Unavailable
    | Progress
    | Pulse
    | StreamWait
    | Chunk
)

_link = msgspec.msgpack.Decoder(LinkMessage)


def decode_link(data: bytes | memoryview) -> LinkMessage:
    """A message on the node link (messages.DecodeError for anything else)."""
    return _link.decode(data)
