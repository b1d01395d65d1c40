"""Typed owners shared by every stage kind: model, load, parallel, connector, runtime, serving.

Each field documents itself (the docstring under it). A field left at its schema default is
"unset" (pydantic's `model_fields_set` and the provenance map say so), so "unset" and "set to the
default" stay distinguishable.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:]+\]")


class Owner(BaseModel):
    """Base of every typed owner: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def set_fields(self) -> dict[str, Any]:
        """Only the fields a config layer set explicitly."""
        return {k: getattr(self, k) for k in self.model_fields_set}


class ModelOwner(Owner):
    """Which weights and tokenizer a stage loads."""

    model: str | None = None
    """This stage's own model folder or hub id (overrides the pipeline's model)."""
    model_subdir: str | None = None
    """Folder of the pipeline model holding this stage's weights (default: the topology's)."""
    tokenizer: str | None = None
    """This stage's own tokenizer folder or hub id."""
    tokenizer_subdir: str | None = None
    """Folder of the pipeline model holding the tokenizer (default: the topology's)."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own Python code to run when loading."""
    revision: str | None = None
    """Hub revision of the model."""
    hf_overrides: dict[str, Any] | None = None
    """Overrides applied to the HF config after loading (AR stages)."""
    quantization: str | None = None
    """Weight quantization method (AR stages; vLLM's `quantization`)."""
    tokenizer_mode: str | None = None
    """vLLM tokenizer mode (AR stages)."""
    skip_tokenizer_init: bool | None = None
    """Let vLLM skip loading a tokenizer (AR stages whose prompts are token ids)."""
    max_model_len: int | None = Field(None, ge=1)
    """Maximum context length of the AR model (prompt + generated tokens)."""
    dtype: str | None = None
    """Weights and activations dtype of the AR model ("auto", "bfloat16", "float32", ...)."""
    seed: int | None = None
    """Engine-level random seed (vLLM's `seed`)."""


class LoadOwner(Owner):
    """How weights are read."""

    load_format: str | None = None
    """Weight file format ("auto", "safetensors", "dummy", ...)."""
    download_dir: str | None = None
    """Where hub downloads are cached."""
    config_format: str | None = None
    """Config file format for vLLM ("auto", "hf", ...)."""


class ParallelOwner(Owner):
    """How one replica of a stage is split across devices."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel degree (AR stages; a diffusion stage runs on one device)."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline-parallel degree (AR stages)."""
    data_parallel_size: int = Field(1, ge=1)
    """Data-parallel degree inside the stage engine (AR stages)."""
    distributed_executor_backend: str | None = None
    """vLLM executor backend ("mp", "ray", "uni")."""
    enable_expert_parallel: bool | None = None
    """Expert parallelism for MoE models (AR stages)."""
    sequence_parallel_size: int | None = Field(None, ge=1)
    """Diffusion sequence-parallel degree (not implemented: values above 1 are refused at load)."""
    ulysses_degree: int | None = Field(None, ge=1)
    """Diffusion Ulysses attention degree (not implemented: values above 1 are refused at load)."""
    ring_degree: int | None = Field(None, ge=1)
    """Diffusion ring attention degree (not implemented: values above 1 are refused at load)."""
    cfg_parallel_size: int | None = Field(None, ge=1)
    """Diffusion CFG-parallel degree (not implemented: values above 1 are refused at load)."""
    vae_patch_parallel_size: int | None = Field(None, ge=1)
    """Diffusion VAE patch-parallel degree (not implemented: values above 1 are refused at load)."""


class ConnectorOwner(Owner):
    """How a stage exchanges payloads with its neighbours."""

    input_connectors: dict[str, str] | None = None
    """vLLM-Omni style `{from_stage_N: connector_name}`."""
    output_connectors: dict[str, str] | None = None
    """vLLM-Omni style `{to_stage_N: connector_name}`."""
    omni_kv_config: dict[str, Any] | None = None
    """vLLM-Omni KV / hidden-state transfer settings (no effect here: payloads cross each edge
    through its connector; warned at load). An override replaces it whole."""
    kv_transfer_config: dict[str, Any] | None = None
    """vLLM KV-transfer config of an AR stage (e.g. our NIXL KV connector)."""
    stream_nixl_min_bytes: int | None = Field(64 << 10, ge=1)
    """A tensor chunk this stage streams to a stage on another node, of at least this many
    bytes, goes through NIXL (the consumer READs it, GPU memory to GPU memory where both have
    one); smaller chunks, other payloads and edges within a node stay inline in the edge's
    frames. None: every chunk inline."""


_DEVICES = re.compile(r"^\d+(,\d+)*$")


class RuntimeOwner(Owner):
    """Where and how the stage process runs."""

    devices: str | None = None
    """Devices of one replica, CUDA_VISIBLE_DEVICES style ("0", "0,1"); None: the platform's default."""
    num_replicas: int = Field(1, ge=1)
    """Copies of this stage behind the orchestrator, each a Ray actor (above 1 needs the
    pipeline's `runtime: {backend: ray}`; refused at load otherwise)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables set in the stage's process (and only there)."""
    enforce_eager: bool | None = None
    """Disable graph capture / compilation."""
    compilation_config: dict[str, Any] | None = None
    """vLLM compilation config (AR stages)."""
    async_chunk: bool | None = None
    """Stream partial outputs to the next stage (no effect: stages run after full inputs here;
    warned at load)."""
    stall_timeout_s: float = Field(300.0, ge=1.0)
    """A stage holding requests that reports no progress (step, tokens) for this long is
    declared stuck: its requests fail with 503 and it is killed and restarted. 300 s outlasts
    the longest silent stretch a healthy stage has: the first torch.compile of a new shape on a
    GPU (tens of seconds) or one full-size DiT step on a CPU; an idle stage is never flagged."""

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, bool):
            raise ValueError('must be a device list such as "0" or "0,1"')
        if isinstance(value, int):
            value = str(value)
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            value = ",".join(map(str, value))
        if not isinstance(value, str) or not _DEVICES.match(value.replace(" ", "")):
            raise ValueError(f'{value!r} is not a device list such as "0" or "0,1"')
        return value.replace(" ", "")

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ValueError("must be a mapping of VARIABLE: value")
        out = {}
        for key, val in value.items():
            if isinstance(val, (dict, list)) or val is None:
                raise ValueError(f"{key}: environment values must be scalars, got {val!r}")
            out[str(key)] = ("true" if val else "false") if isinstance(val, bool) else str(val)
        return out

    @property
    def device_count(self) -> int | None:
        return len(self.devices.split(",")) if self.devices else None


class ServingLimits(Owner):
    """Request bounds the HTTP layer enforces (top-level `serving:` section, pipeline-wide).

    Size and step bounds live on the final diffusion stage's `DiffusionOwner`.
    """

    max_n: int = Field(4, ge=1, le=64)
    """Most images one request may ask for (`n`)."""
    max_prompt_chars: int = Field(4000, ge=1)
    """Longest prompt accepted, in characters."""
    max_negative_prompt_chars: int = Field(4000, ge=0)
    """Longest negative prompt accepted, in characters."""
    request_timeout_s: float = Field(600.0, gt=0)
    """A request still unfinished after this long fails with a timeout error."""
    max_queued_requests: int = Field(32, ge=0, le=100_000)
    """Image requests admitted but not yet running (beyond the final stage's max_batch_size per
    replica, which run); past it a request gets 429 with Retry-After. Uploads count too."""
    edit_url_hosts: tuple[str, ...] = ()
    """Hosts whose http(s) URLs the server fetches (none by default): an edit's source images,
    a video job's `input_reference`, a chat request's image, audio and video parts. A URL on
    any other host is a 400 (`url_not_allowed`)."""

    @field_validator("edit_url_hosts", mode="before")
    @classmethod
    def _hostnames(cls, value: Any) -> Any:
        hosts = [value] if isinstance(value, str) else value
        for host in hosts or ():
            if not isinstance(host, str) or not _HOSTNAME.fullmatch(host):
                raise ValueError(
                    f"edit_url_hosts: {host!r} is not a host name (no scheme, path or port)"
                )
        return tuple(h.lower() for h in hosts or ())

    max_input_audio_s: float = Field(300.0, gt=0)
    """Longest audio part (`input_audio`, or an `audio_url` data URL) a chat request may carry,
    in seconds of audio (longer: a 400)."""
    max_media_parts: int = Field(32, ge=0, le=10_000)
    """Most image, audio and video content parts one chat request may carry, all messages
    together (more: a 400; 0: text only)."""
    max_media_part_bytes: int = Field(20 * 1024 * 1024, ge=1)
    """Largest decoded size, in bytes, of one base64 media part (`input_audio` data or a
    `data:` URL); checked on the base64 length, before any decoding (larger: a 400)."""
    max_input_video_frames: int = Field(3600, ge=1)
    """Most frames one video part (a `video_url` data URL) may hold, read from its container
    (more: a 400). 3600: two minutes at 30 fps."""
    max_input_image_pixels: int = Field(7680 * 4320, ge=1)
    """Most pixels (width x height, read from the image header or the video container) one image
    part, or one frame of a video part, may have (more: a 400). The default is an 8K frame."""
