"""Control messages between the orchestrator (API server) and a stage process.

They travel pickled over one socket pair per stage (multiprocessing.connection framing). Large
payloads between stages go through a connector; these messages carry its small descriptors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageInit:
    """First message to a new stage process: its typed config, never a dict."""

    stage: Any  # vllm_omni_plugin.config.StageConfig
    spec: Any  # vllm_omni_plugin.pipelines StageSpec: kind, inputs, emits
    pipeline: str  # topology key, e.g. "glm_image"
    connectors: dict[str, Any] = field(default_factory=dict)  # name -> ConnectorSpec


@dataclass
class Ready:
    """The stage loaded its model.

    `info` is plain data (it also travels through the multi-node registry): "kind"; a final
    diffusion stage's "limits" (`RequestLimits.to_dict()`, read back with `from_dict`: the API
    server validates requests against them); "effective": the settings the stage actually runs
    with, read back from its engine (see `describe` in each stage runner).
    """

    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationParams:
    """One validated request's generation parameters, as every stage receives them."""

    prompt: str
    n: int = 1
    height: int | None = None
    width: int | None = None
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    output_format: str = "png"
    output_compression: int | None = None
    # Streaming (POST /v1/images/generations with stream: true): the stages send Progress
    # messages for this request; a diffusion stage also decodes `partial_images` previews.
    stream: bool = False
    partial_images: int = 0
    # /v1/videos jobs (output_format "mp4"): frames of the video and frames per second.
    num_frames: int | None = None
    fps: int | None = None
    # Edits (POST /v1/images/edits). The contract between the API server and every stage:
    # `input_images` are the request's source images in upload order, each one already checked
    # (bytes, pixels, format) and decoded by the API server, then re-encoded as a lossless 8-bit
    # RGB PNG (mode "RGB", no alpha, EXIF rotation applied): decode with
    # `PIL.Image.open(io.BytesIO(b))` and get exactly the uploaded pixels. Bytes rather than
    # arrays, so the params stay plain data on every link (the multi-node msgpack one too).
    # Empty for text-to-image. At most the pipeline topology's `max_input_images`.
    input_images: list[bytes] = field(default_factory=list)
    # The edit's mask as a lossless 8-bit grayscale PNG (mode "L") of the first input image's
    # size: 255 where the image is to be repainted (OpenAI's fully transparent mask pixels),
    # 0 where it is kept. None: no mask. Only for topologies with `accepts_mask`.
    mask: bytes | None = None
    # The model family's own knobs this request sets (name -> value, checked by the API server
    # against the knobs the final stage announced; DiffusionAdapter.knobs).
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Submit:
    request_id: str
    params: GenerationParams
    # Outputs of upstream stages: stage_id -> connector descriptor (or the payload itself
    # when no connector is configured for that edge).
    inputs: dict[int, Any] = field(default_factory=dict)
    # Connector name for this stage's own output (None: send it back inline).
    out_connector: str | None = None
    to_stage: int | None = None
    # Streamed edges (stages/streams.py): the inputs that arrive as Chunks instead of in
    # `inputs`, and whether this stage emits its output as Chunks (at most `stream_window` of
    # them not yet consumed) before its Result.
    stream_inputs: list[int] = field(default_factory=list)
    stream_output: bool = False
    stream_window: int = 0


@dataclass
class Abort:
    request_id: str


@dataclass
class Chunk:
    """One ordered piece of a request's output on a streamed edge (stages/streams.py).

    Producer -> orchestrator -> consumer (or the API server, for a final stage). `payload` is
    a connector descriptor (the edge's connector) or the value inline (no connector: a final
    stage's chunks). The end marker has `end` set, no payload, and `seq` = the number of
    chunks before it."""

    request_id: str
    from_stage: int
    seq: int
    payload: Any = None
    end: bool = False


@dataclass
class ChunkDone:
    """Consumer -> orchestrator: chunk `seq` from `from_stage` was consumed (its buffer
    released, the consumer done with it); the orchestrator hands the producer a Credit."""

    request_id: str
    stage_id: int
    from_stage: int
    seq: int


@dataclass
class Credit:
    """Orchestrator -> producer: chunk `seq` of the request was consumed, so one more may be
    emitted (the producer holds at most its window of unconsumed chunks per request)."""

    request_id: str
    seq: int


@dataclass
class Shutdown:
    pass


@dataclass
class Inspect:
    """Ask a stage what it holds now (the guarded GET /v1/omni/stages?live=1). The stage answers
    with an Inspection from the loop that drives its engine, so a diffusion stage answers
    between two steps, after the Aborts that arrived before this message."""

    token: int


@dataclass
class Inspection:
    """A stage's own view of its work, read from its engine (not the API server's bookkeeping).
    `requests`: the requests the stage holds now (a diffusion engine: waiting or running, with
    {"step", "total_steps"}; an AR stage: its running generations). `engine_unfinished`: the
    engine's own count of unfinished requests (vLLM's, for an AR stage); None if unknown.
    `submitted`: Submits this process received since it started, valid or not. `at`: when the
    stage answered (the API server's reply comes later, by however busy it is)."""

    token: int
    stage_id: int
    requests: dict[str, dict[str, int]] = field(default_factory=dict)
    engine_unfinished: int | None = None
    submitted: int = 0
    at: float = 0.0  # the stage's wall clock (time.time()) when it answered: when this was true


@dataclass
class Progress:
    """A streaming request's progress in one stage, sent before its Result (only for requests
    whose params say `stream`). `step` of `total_steps`: denoising steps in a diffusion stage,
    generated tokens of at most `total_steps` in an AR stage. `preview`: encoded preview images
    (one per image of the request) of the x0 prediction after this step, with its 0-based
    `preview_index` among the request's partial images."""

    request_id: str
    stage_id: int
    stage: str  # the stage's kind: "diffusion" | "ar"
    step: int
    total_steps: int
    preview: list[bytes] | None = None
    preview_index: int | None = None


@dataclass
class Result:
    request_id: str
    # Final stages: list of encoded images (bytes). Intermediate stages: a connector
    # descriptor, or the payload inline.
    output: Any = None
    error: str | None = None
    error_field: str | None = None  # set for request validation errors (-> HTTP 400)
    stage_s: float = 0.0  # time the stage spent on this request, from receipt to reply
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pulse:
    """A stage's engine loop made progress (a diffusion step ran, an AR engine produced
    tokens). Sent from the loop that does the work, never from a side thread, at most every
    PULSE_INTERVAL_S, and only while the stage has work: the orchestrator's stall watchdog
    (runtime.stall_timeout_s) reads work messages (Result, Progress, Pulse) as progress; this one keeps
    non-streaming requests, which get no Progress, visible to it."""

    stage_id: int


# The least time between two Pulses of one stage: a pulse per step would cost a message per
# millisecond on tiny models, while a watchdog deadline is seconds at least.
PULSE_INTERVAL_S = 0.25


@dataclass
class EngineMetrics:
    """An AR stage's own vLLM Prometheus metrics (the `vllm:` families of its process's
    registry), sent every ENGINE_METRICS_INTERVAL_S; the API server's /metrics shows them with
    the stage's labels added. Sent on a timer, so it is no sign of progress: the stall
    watchdog ignores it. `families`: (name, type, help, [(sample name, labels, value)])."""

    stage_id: int
    families: list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]
    # This process's connector counters (stats_relay.py). A producer learns a handoff completed
    # only after it sent that request's Result, so without this timer its counts would lag
    # until its next request.
    connector_stats: dict[str, Any] | None = None


# Staleness of the AR engines' metrics on /metrics (scrapers poll every 10-60 s).
ENGINE_METRICS_INTERVAL_S = 2.0
