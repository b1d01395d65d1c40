"""What the two halves of the NIXL connector share: the READ location a descriptor carries, the
producer's record of a payload it keeps alive (a lease), and the slot-header layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_plugin.common.payload import NixlLocation
from vllm_omni_plugin.connectors.staging import ALIGN

__all__ = ["HEADER", "Lease", "MiB", "NixlLocation", "RELEASE_PREFIX"]

HEADER = ALIGN  # tag in the first 8 bytes; the payload after it stays aligned
RELEASE_PREFIX = b"omni-rel:"
MiB = 1 << 20


@dataclass
class Lease:
    nbytes: int
    t0: float
    until: float
    offset: int | None = None  # send-pool slot
    tensor: torch.Tensor | None = None  # payload registered in place, or an empty() payload
    reg: Any = None
    tag_offset: int | None = None  # empty() payload: its slot's tag, cleared at release
