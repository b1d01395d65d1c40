"""What the thinker stage and its vLLM worker agree on: where the settings travel, which request
is extracted, and the wire format of one step's states.

The settings travel in `VllmConfig.additional_config[ADDITIONAL_CONFIG_KEY]` (vLLM hands that
dict to every worker unchanged). A request is extracted only if its `SamplingParams.extra_args`
names a key under `REQUEST_KEY`: the warm-up request and text-only callers cost nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ADDITIONAL_CONFIG_KEY = "omni_thinker_states"
REQUEST_KEY = "omni_thinker_states_key"
# The worker subclass the stage puts in `worker_cls` (a dotted path, as vLLM reads it).
WORKER_CLS = "vllm_omni_plugin.models.thinker_states.worker.ThinkerStatesWorker"

# Defaults of the stage's bounds (bytes held in the stage process, not yet consumed). One
# full-size Qwen3-Omni position (hidden 2048, two layers, bf16) is 8 KiB: 64 MiB holds 8192
# positions of one request, 1 GiB about 16 such requests in flight at once.
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
DEFAULT_MAX_TOTAL_BYTES = 1 << 30


@dataclass(frozen=True)
class EngineSettings:
    """The part the worker reads: which decoder-layer inputs to capture and where to send them.

    `layers` are indices of decoder-layer inputs: 0 is what layer 0 receives (the input
    embeddings, media merged in), k is the output of layer k-1 (residual added, deepstack
    merged), the same numbering as transformers' `hidden_states[k]`.
    """

    layers: tuple[int, ...]
    endpoint: str
    # "auto": the model's auxiliary hidden-state outputs where it has them, else capture buffers
    # written by the decoder layers; "buffer": the buffers always (what vLLM < 0.29 runs; tests
    # pick it to check it).
    capture: str = "auto"

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "endpoint": self.endpoint, "capture": self.capture}

    @classmethod
    def from_additional_config(cls, additional: dict | None) -> EngineSettings | None:
        raw = (additional or {}).get(ADDITIONAL_CONFIG_KEY)
        if not raw or not raw.get("endpoint"):
            return None
        return cls(
            layers=tuple(int(x) for x in raw["layers"]),
            endpoint=str(raw["endpoint"]),
            capture=str(raw.get("capture", "auto")),
        )


@dataclass(frozen=True)
class StageSettings:
    """The stage's opt-in (`additional_config: {omni_thinker_states: {...}}` in a stage config).

    `accept_layer` None: the checkpoint's `talker_config.accept_hidden_layer`.
    """

    accept_layer: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES
    capture: str = "auto"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StageSettings:
        known = {"accept_layer", "max_request_bytes", "max_total_bytes", "capture"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{ADDITIONAL_CONFIG_KEY}: unknown keys {sorted(unknown)}")
        if raw.get("capture", "auto") not in ("auto", "buffer"):
            raise ValueError(f"{ADDITIONAL_CONFIG_KEY}.capture: 'auto' or 'buffer'")
        return cls(
            accept_layer=raw.get("accept_layer"),
            max_request_bytes=int(raw.get("max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)),
            max_total_bytes=int(raw.get("max_total_bytes", DEFAULT_MAX_TOTAL_BYTES)),
            capture=str(raw.get("capture", "auto")),
        )


@dataclass(frozen=True)
class ChunkHeader:
    """One request's rows in a step message: positions [start, start + count)."""

    key: str
    start: int
    count: int


@dataclass
class StepHeader:
    """A step message is [header, layer buffers...]: buffer i holds `layers[i]`'s rows of every
    chunk, concatenated in chunk order, each row `dim` values of `dtype`."""

    layers: tuple[int, ...]
    dtype: str
    dim: int
    chunks: list[ChunkHeader] = field(default_factory=list)

    def encode(self) -> bytes:
        return json.dumps(
            {
                "layers": list(self.layers),
                "dtype": self.dtype,
                "dim": self.dim,
                "chunks": [[c.key, c.start, c.count] for c in self.chunks],
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> StepHeader:
        d = json.loads(raw)
        return cls(
            layers=tuple(d["layers"]),
            dtype=d["dtype"],
            dim=int(d["dim"]),
            chunks=[ChunkHeader(k, int(s), int(n)) for k, s, n in d["chunks"]],
        )


def step_frames(layers: tuple[int, ...], chunks: list[ChunkHeader], tensors: list) -> list:
    """A step message's frames: the header, then one `[rows, dim]` tensor per layer (torch,
    on the host, rows of every chunk in chunk order) as raw bytes."""
    import torch

    tensors = [t.contiguous() for t in tensors]
    header = StepHeader(
        layers=tuple(layers),
        dtype=str(tensors[0].dtype).removeprefix("torch."),
        dim=int(tensors[0].shape[-1]),
        chunks=list(chunks),
    )
    return [header.encode(), *(t.view(torch.uint8).numpy() for t in tensors)]
