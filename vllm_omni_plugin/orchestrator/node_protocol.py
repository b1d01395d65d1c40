"""Head <-> headless-node control protocol (multi-node stage deployments).

Transport (link.py): one TCP connection per node. Both sides first prove they hold the shared
key (an HMAC-SHA256 challenge in each direction); after that, length-prefixed frames each hold
one msgpack-encoded message below. Every message is a tagged `msgspec.Struct`, decoded against
the closed union `Message`: an unknown tag, a missing field or a wrong type is a decode error
and the peer is dropped. Decoding builds only these structs and plain data (str, int, float,
bool, None, bytes, list, dict), never an arbitrary object, so a peer, even one holding the
key, cannot make the other side run code. No pickle on this link.

The key:
* `VLLM_OMNI_AUTHKEY` (same value on the head and every node). Required whenever the registry
  listens on, or a node connects to, an address that is not loopback; start-up refuses otherwise.
* On loopback only, without it, both sides derive a key from the pipeline's name and topology.
  It is not a secret (it stops a node of another pipeline, not a local user), and it needs no
  side channel between the separately started head and node processes; what a local process
  holding it can do is bounded by the typed protocol (register as a node), not code execution.

Payloads never ride this link: a Submit/Result carries a connector descriptor (the consumer
pulls the payload over NIXL/shm), the final stage's encoded images (bytes), or, for an edge
without a connector, an inline tensor as explicit dtype/shape/bytes.

Conversation (N = node, H = head):
    N -> H  Register(node, host, pid, stages)   the stages it runs and their status
    H -> N  Welcome(head) | Rejected(reason)
    H -> N  ToStage(stage_id, StageSubmit | StageAbort)
    N -> H  StageResult | Unavailable(request_id)   Unavailable: the node's stage is down (503)
    N -> H  StageProgress                       a streaming request's step (stages' Progress)
    N -> H  StagePulse(stage_id)                the stage's engine loop made progress (Pulse)
    N -> H  Heartbeat(stages)                   every HEARTBEAT_S; the head answers Ping
    H -> N  Superseded(reason)                  a newer node registered the same stage: exit
Either side declares the other dead on EOF or after DEAD_AFTER_S without a message.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import socket
from typing import Any, Literal, Union

import msgspec

from ..stages.messages import Abort, Result, Submit

AUTHKEY_ENV = "VLLM_OMNI_AUTHKEY"
HEARTBEAT_ENV = "VLLM_OMNI_HEARTBEAT_S"

HEARTBEAT_S = float(os.environ.get(HEARTBEAT_ENV, "1.0"))
DEAD_AFTER_S = 5 * HEARTBEAT_S  # missed heartbeats before a peer counts as dead
REGISTER_TIMEOUT_S = 10.0  # a connection must say Register (or Welcome) within this
DEFAULT_BIND = "127.0.0.1"  # the registry listens on loopback unless told otherwise


# ---- status --------------------------------------------------------------------------------
class StageStatus(msgspec.Struct):
    """One stage on a node, as the node sees it."""

    kind: str
    ready: bool
    info: dict[str, Any] = {}  # the stage's Ready info (limits, ...): plain data only
    restarts: int = 0
    deaths: int = 0
    pid: int | None = None


# ---- payload values on the control path ----------------------------------------------------
class WireNixlLocation(msgspec.Struct, tag="nixl"):
    """connectors.nixl.NixlLocation, field for field."""

    agent_name: str
    incarnation: str
    agent_md: bytes
    region_md: bytes | None
    addr: int
    length: int
    dev_id: int
    mem_type: str
    tag: int


class WireDescriptor(msgspec.Struct, tag="descriptor"):
    """A connector descriptor (connectors.base.PayloadDescriptor) and the edge's connector name."""

    via: str  # the connector's name in the deploy config
    connector: str
    name: str
    key: str
    request_id: str
    from_stage: int
    to_stage: int
    kind: Literal["tensor", "bytes", "object"]
    dtype: str | None
    shape: tuple[int, ...]
    nbytes: int
    lease_s: float
    location: str | WireNixlLocation | None = None  # shm: a file path; nixl: see above


class WireTensor(msgspec.Struct, tag="tensor"):
    """An inline tensor (an edge without a connector): explicit dtype, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


# A value a stage hands on: a descriptor, an inline tensor, encoded images, or nothing.
WireValue = Union[WireDescriptor, WireTensor, list[bytes], None]


# ---- messages ------------------------------------------------------------------------------
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


class StageSubmit(msgspec.Struct, tag=True):
    """stages.messages.Submit on the wire."""

    request_id: str
    params: dict[str, Any]  # the validated request's generation parameters (plain data)
    inputs: dict[int, WireValue] = {}
    out_connector: str | None = None
    to_stage: int | None = None


class StageAbort(msgspec.Struct, tag=True):
    request_id: str


class ToStage(msgspec.Struct, tag=True):
    """A Submit or Abort for one of the node's stages."""

    stage_id: int
    msg: StageSubmit | StageAbort


class StageResult(msgspec.Struct, tag=True):
    """stages.messages.Result on the wire."""

    request_id: str
    output: WireValue = None
    error: str | None = None
    error_field: str | None = None
    stage_s: float = 0.0
    metrics: dict[str, Any] = {}


class Unavailable(msgspec.Struct, tag=True):
    """The node could not run the request because its stage is down (HTTP 503)."""

    request_id: str
    message: str


class StageProgress(msgspec.Struct, tag=True):
    """stages.messages.Progress on the wire: a streaming request's step in a node's stage."""

    request_id: str
    stage_id: int
    stage: str
    step: int
    total_steps: int
    preview: list[bytes] | None = None
    preview_index: int | None = None


class StagePulse(msgspec.Struct, tag=True):
    """A node's stage made progress (its Pulse, relayed as it comes): the head's stall
    watchdog reads these and StageProgress, never the node's heartbeats, which a node with a
    stuck stage still sends."""

    stage_id: int


# Everything that may cross the link; anything else is refused at decode.
Message = Union[
    Register,
    Welcome,
    Rejected,
    Superseded,
    Heartbeat,
    Ping,
    ToStage,
    StageResult,
    Unavailable,
    StageProgress,
    StagePulse,
]


# ---- stage messages <-> wire ---------------------------------------------------------------
def value_to_wire(value: Any) -> Any:
    """A payload value from StagePayloads.emit (or a stage's output) in its wire form."""
    from ..stages.payloads import _Via

    if value is None:
        return None
    if isinstance(value, _Via):
        d = value.desc
        loc = d.location
        if loc is not None and not isinstance(loc, str):
            loc = WireNixlLocation(
                **{f: getattr(loc, f) for f in WireNixlLocation.__struct_fields__}
            )
        return WireDescriptor(
            value.connector,
            d.connector,
            d.name,
            d.key,
            d.request_id,
            d.from_stage,
            d.to_stage,
            d.kind,
            d.dtype,
            tuple(d.shape),
            d.nbytes,
            d.lease_s,
            loc,
        )
    if isinstance(value, list) and all(isinstance(v, (bytes, bytearray)) for v in value):
        return [bytes(v) for v in value]
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        return WireTensor(
            str(t.dtype).removeprefix("torch."), tuple(t.shape), raw.numpy().tobytes()
        )
    raise TypeError(
        f"a {type(value).__name__} cannot cross the node link: configure a connector (nixl) "
        "for this edge, so only its descriptor travels"
    )


def value_from_wire(value: Any) -> Any:
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, WireTensor):
        import torch

        dtype = getattr(torch, value.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"inline tensor with unknown dtype {value.dtype!r}")
        flat = torch.frombuffer(bytearray(value.data), dtype=torch.uint8) if value.data else None
        if flat is None:
            return torch.empty(value.shape, dtype=dtype)
        return flat.view(dtype).reshape(value.shape)
    from ..connectors.base import PayloadDescriptor
    from ..stages.payloads import _Via

    loc: Any = value.location
    if isinstance(loc, WireNixlLocation):
        from ..connectors.nixl import NixlLocation

        loc = NixlLocation(**msgspec.structs.asdict(loc))
    desc = PayloadDescriptor(
        value.connector,
        value.name,
        value.key,
        value.request_id,
        value.from_stage,
        value.to_stage,
        value.kind,
        value.dtype,
        tuple(value.shape),
        value.nbytes,
        value.lease_s,
        location=loc,
    )
    return _Via(value.via, desc)


def _params_to_wire(params: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    return dict(params)


def _params_from_wire(params: dict[str, Any]) -> Any:
    """The typed parameters Submit carries (stages.messages.GenerationParams), checked field by
    field: an unknown field (a head newer than this node) is refused, not silently dropped."""
    from ..stages import messages

    typed = getattr(messages, "GenerationParams", None)
    if typed is None:  # Submit still carries a plain dict
        return params
    known = {f.name for f in dataclasses.fields(typed)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"unknown generation parameter(s) {unknown} from the head")
    try:
        return msgspec.convert(params, typed)
    except msgspec.ValidationError as exc:
        raise ValueError(f"generation parameters: {exc}") from None


def submit_to_wire(msg: Submit | Abort) -> StageSubmit | StageAbort:
    if isinstance(msg, Abort):
        return StageAbort(msg.request_id)
    return StageSubmit(
        msg.request_id,
        _params_to_wire(msg.params),
        {sid: value_to_wire(v) for sid, v in msg.inputs.items()},
        msg.out_connector,
        msg.to_stage,
    )


def submit_from_wire(msg: StageSubmit | StageAbort) -> Submit | Abort:
    if isinstance(msg, StageAbort):
        return Abort(msg.request_id)
    return Submit(
        msg.request_id,
        _params_from_wire(msg.params),
        {sid: value_from_wire(v) for sid, v in msg.inputs.items()},
        msg.out_connector,
        msg.to_stage,
    )


def result_to_wire(msg: Result) -> StageResult:
    return StageResult(
        msg.request_id,
        value_to_wire(msg.output),
        msg.error,
        msg.error_field,
        float(msg.stage_s),
        dict(msg.metrics),
    )


def result_from_wire(msg: StageResult) -> Result:
    return Result(
        msg.request_id,
        value_from_wire(msg.output),
        msg.error,
        msg.error_field,
        msg.stage_s,
        msg.metrics,
    )


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
    """The connection key: $VLLM_OMNI_AUTHKEY; on loopback only, else one derived from the
    pipeline (see above). SystemExit naming the variable when `host` is not loopback."""
    explicit = os.environ.get(AUTHKEY_ENV)
    if explicit:
        return explicit.encode()
    require_explicit_key(host, role)
    shape = ",".join(f"{s.stage_id}:{s.kind}:{sorted(s.inputs)}" for s in cfg.topology.stages)
    return hashlib.sha256(f"vllm-omni-plugin/{cfg.pipeline}/{shape}".encode()).digest()


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
