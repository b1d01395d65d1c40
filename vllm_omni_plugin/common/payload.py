"""What a stage hands the next one on the control path: a connector descriptor (the payload
itself stays in the connector), an inline tensor (an edge without a connector), or encoded
images (a final stage). Typed msgspec structs: they travel inside the messages of messages.py.

Payload kinds are closed: a raw tensor, raw bytes, or a msgspec struct registered here. Nothing
is ever unpickled, and a descriptor of any other kind is refused before its bytes are read.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PayloadKind = Literal["tensor", "bytes", "struct"]
PAYLOAD_KINDS: tuple[str, ...] = ("tensor", "bytes", "struct")

# Struct payloads: the descriptor's `dtype` names the type, looked up here before decoding (an
# unknown name is refused like an unknown kind). One line per payload type a stage emits.
PAYLOAD_STRUCTS: dict[str, type[msgspec.Struct]] = {}


def payload_struct(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """Class decorator: `cls` may travel as a payload of kind "struct" (under its name)."""
    PAYLOAD_STRUCTS[cls.__name__] = cls
    return cls


class NixlLocation(msgspec.Struct, frozen=True, tag="nixl"):
    """Where a NIXL consumer READs a payload from: the producer agent and the memory."""

    agent_name: str
    incarnation: str
    agent_md: bytes
    region_md: bytes | None  # partial metadata of a payload registered on its own
    addr: int
    length: int  # bytes to READ (header + payload for pool slots)
    dev_id: int
    mem_type: str  # DRAM | VRAM
    tag: int  # 0: no header


class PayloadDescriptor(msgspec.Struct, frozen=True):
    """What travels on the control path instead of the payload (a few hundred bytes).

    `location` is transport specific (a file path for shm, agent metadata + remote address for
    NIXL) and read by the connector kind that made it only. `kind` is checked against
    PAYLOAD_KINDS by the consumer before anything is fetched or decoded, so it is a plain str
    here: a forged kind reaches that check (and fails the one request) instead of failing the
    whole message.
    """

    connector: str  # kind of the connector that made it: inproc | shm | nixl
    name: str  # the connector's name (metrics label)
    key: str  # unique per put
    request_id: str
    from_stage: int
    to_stage: int
    kind: str  # one of PAYLOAD_KINDS
    dtype: str | None  # torch dtype name for tensors ("float16"); the struct's name for structs
    shape: tuple[int, ...]
    nbytes: int
    lease_s: float
    location: str | NixlLocation | None = None


class Via(msgspec.Struct, frozen=True, tag=True):
    """A connector descriptor and the name of the edge's connector in the deploy config."""

    connector: str
    desc: PayloadDescriptor


class InlineTensor(msgspec.Struct, frozen=True, tag=True):
    """A tensor on an edge without a connector: explicit dtype, shape and raw bytes."""

    dtype: str  # torch dtype name, e.g. "int64"
    shape: tuple[int, ...]
    data: bytes


# What a stage's Result carries and a Submit's inputs hold: a descriptor, an inline tensor,
# the final stage's encoded images (or video), or nothing; a streamed chunk may also be raw
# bytes (a final stage's piece, inline).
StageOutput = Via | InlineTensor | list[bytes] | bytes | None
