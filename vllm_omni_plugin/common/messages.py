"""Every message between the API server, stage processes, headless nodes and replicas.

One schema, one encoding: each message is a tagged `msgspec.Struct` encoded as msgpack, on the
local socket pair of a stage (orchestrator/frames.py, common/channel.py) and on the node link
(orchestrator/link.py, its own structs in link_messages.py) alike. A reader decodes against the
closed union of what may arrive on its side (ToStageMessage, FromStageMessage, LinkMessage): an
unknown tag, a missing field or a wrong type is a decode error, and decoding only ever builds
these structs and plain data, never an arbitrary object, so a peer cannot make the other side
run code. Large payloads between stages go through a connector; these messages carry its small
descriptors (payload.py).

Local stage conversation (H = API server, S = stage process):
    H -> S  StartStage                          first: the stage's typed config
    S -> H  Ready(pid, info)                    the model is loaded; limits and settings
    H -> S  Submit | Abort | Inspect | Shutdown
    S -> H  Result | Progress | Pulse | Inspection | EngineMetrics
    S -> H  Chunk   H -> S  Credit              a final stage's streamed output (stages/streams.py)
    S -> H  StreamWait                          a request waits on its stage-to-stage peer
    S <-> S edge channel (connectors/edge_channel.py): a streamed edge's chunks and credits

A process that starts stages (H) and its stages' fork server (F, stages/fork_server.py):
    F -> H  ForkServerReady                     first: its imports are done
    H -> F  ForkStage (+ two descriptors)       F -> H  Forked(pid)
    F -> H  StageExited(pid, returncode)        whenever a stage it forked ends
"""

from __future__ import annotations

from typing import Any

import msgspec

from .limits import RequestLimits
from .memory import MemoryModel
from .payload import StageOutput
from .text_messages import GenerateText, TextOutput

# Plain values read back from an engine's own config (vLLM's sections, the diffusion engine's
# config): str, int, float, bool, None, and lists and str-keyed dicts of them.
PlainSettings = dict[str, Any]


# ---- start-up ------------------------------------------------------------------------------
class StartStage(msgspec.Struct, tag=True):
    """First message to a new stage process: its typed config. The pydantic StageConfig,
    the pipeline's StageSpec and the connector specs travel as their JSON and are validated
    again, field by field, by the stage (config/stage_init.py builds and reads this)."""

    stage_id: int
    kind: str  # the topology's stage kind
    pipeline: str  # topology key, e.g. "glm_image"
    stage: bytes  # config.StageConfig, model_dump_json
    spec: bytes  # pipelines.StageSpec, JSON
    connectors: dict[str, bytes] = {}  # name -> config.ConnectorSpec, model_dump_json


class VideoFacts(msgspec.Struct, frozen=True):
    """What /v1/videos checks a request against: frames are 1 + k * frame_step; source images
    (`input_reference`) the model takes (0: text-to-video only) and whether it needs one."""

    frame_step: int
    default_num_frames: int
    max_input_images: int = 0
    requires_input_image: bool = False


class ARSettings(msgspec.Struct, tag_field="kind", tag="ar"):
    """The settings an AR stage runs with, read back from its engine's VllmConfig."""

    model_config: PlainSettings
    cache_config: PlainSettings
    scheduler_config: PlainSettings
    parallel_config: PlainSettings
    load_config: PlainSettings
    default_sampling_params: PlainSettings
    environ: dict[str, str | None] = {}  # the stage's own environment (its config's `env`)


class RunnerSettings(msgspec.Struct, tag_field="kind", tag="runner"):
    """A stage whose loop the topology names (`StageSpec.runner`): which one, and its
    environment."""

    runner: str  # "module:Class"
    environ: dict[str, str | None] = {}


class EngineSettings(msgspec.Struct, tag_field="kind", tag="engine"):
    """The settings a stage of a kind with its own engine (the talker, Code2Wav) runs with:
    its typed deploy settings as its engine took them."""

    settings: PlainSettings
    environ: dict[str, str | None] = {}


class DiffusionSettings(msgspec.Struct, tag_field="kind", tag="diffusion"):
    """The settings a diffusion stage runs with, read back from its live engine."""

    engine: PlainSettings  # the engine's DiffusionEngineConfig
    device: str
    dtype: str
    memory_budget_bytes: int | None
    scheduler_max_batch_size: int
    scheduler_max_wait_s: float
    vae_use_slicing: bool | None
    vae_use_tiling: bool | None
    torch_threads: int
    cuda_visible_devices: str | None
    environ: dict[str, str | None] = {}


class StageInfo(msgspec.Struct, omit_defaults=True):
    """What a ready stage announces (GET /v1/omni/stages shows it as JSON)."""

    kind: str  # the topology's stage kind
    effective: ARSettings | DiffusionSettings | EngineSettings | RunnerSettings
    pipeline: str | None = None  # an AR stage's topology key
    model: str | None = None  # an AR stage's model
    pipeline_class: str | None = None  # a diffusion stage's diffusers pipeline class
    limits: RequestLimits | None = None  # a diffusion stage's bounds: serving validates with them
    video: VideoFacts | None = None  # a video family's frame rules
    # A diffusion stage's memory plan (None: no budget set): what a request needs, what is left.
    memory: MemoryModel | None = None
    # A diffusion stage's family ("Qwen-Image"), the knobs it applies beyond the common request
    # fields (diffusion.knobs.Knob.to_dict()), the common fields it does not apply -> why, and
    # its CFG rule (diffusion.knobs.CfgFacts.to_dict()); serving/request_fields.py reads them.
    family: str | None = None
    knobs: list[dict[str, Any]] = []
    unsupported: dict[str, str] = {}
    cfg: dict[str, Any] | None = None
    # A diffusion stage serving LoRA adapters: its resolved `lora.dir`, max_loaded, max_rank,
    # family and target linears (module name -> [in, out]); requests and runtime loads are
    # checked against them (serving/lora_adapters.py). None: no LoRA.
    lora: dict[str, Any] | None = None


class Ready(msgspec.Struct, tag=True):
    """The stage loaded its model."""

    pid: int
    info: StageInfo
    # Where this stage's producers open their streamed edges' channels (stages/edge_streams.py;
    # empty: it takes no streamed inputs).
    edge_address: str = ""
    # The same for producers on other nodes (a stage on a headless node; empty: none).
    edge_tcp_address: str = ""


# ---- requests ------------------------------------------------------------------------------
class ChatPrompt(msgspec.Struct, frozen=True):
    """What the talker reads of a speech request's chat prompt, taken in the API server from the
    chat stage's processed request: its token ids, and each image's and video's patch grid in
    prompt order as (t, h, w, seconds one temporal grid step spans; 1.0 for an image). The
    media themselves go only to the chat stage (`chat_request`)."""

    token_ids: list[int] = []
    visual_grids: list[tuple[int, int, int, float]] = []


class GenerationParams(msgspec.Struct, frozen=True, tag="generation"):
    """One validated request's generation parameters, as the AR and diffusion stages receive
    them (the talker and Code2Wav receive only their part: `stage_params`)."""

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
    # Step caching: {"policy": ..., params} as the API server checked it (None: the stage's
    # default); the diffusion stage checks it against its own step_cache bounds.
    cache: dict[str, Any] | None = None
    # Edits (POST /v1/images/edits). The contract between the API server and every stage:
    # `input_images` are the request's source images in upload order, each one already checked
    # (bytes, pixels, format) and decoded by the API server, then re-encoded as a lossless 8-bit
    # RGB PNG (mode "RGB", no alpha, EXIF rotation applied): decode with
    # `PIL.Image.open(io.BytesIO(b))` and get exactly the uploaded pixels. Empty for
    # text-to-image. At most the pipeline topology's `max_input_images`.
    input_images: list[bytes] = []
    # The edit's mask as a lossless 8-bit grayscale PNG (mode "L") of the first input image's
    # size: 255 where the image is to be repainted (OpenAI's fully transparent mask pixels),
    # 0 where it is kept. None: no mask. Only for topologies with `accepts_mask`.
    mask: bytes | None = None
    # The model family's own knobs this request sets (name -> value, checked by the API server
    # against the knobs the final stage announced; DiffusionAdapter.knobs).
    knobs: dict[str, float | int | bool | str] = {}
    # LoRA adapters: [{"name", "scale", "path"}] as the API server checked them, `path` the
    # adapter's folder relative to the diffusion stage's lora.dir. Empty: none.
    lora: list[dict[str, Any]] = []
    # Speech (a chat request with `modalities: ["text", "audio"]`, topologies with
    # `audio_output`): the chat stage's vLLM EngineCoreRequest, rendered and processed by vLLM in
    # the API server and encoded as in GenerateText (its sampling params' output kind is DELTA:
    # the chat stage sends each text piece to the API server as a TextOutput, the transcript),
    # what the talker reads of its prompt (ChatPrompt), and the checkpoint's speaker to answer
    # as. Empty / None for every other request.
    chat_request: list[bytes] = []
    chat_prompt: ChatPrompt | None = None
    voice: str | None = None
    # The talker's sampling for this speech request (serving/speech_request.SPEECH_SAMPLING),
    # over its stage's defaults.
    speech_sampling: dict[str, float | int] = {}


class TalkerParams(msgspec.Struct, frozen=True, tag="talker"):
    """What a talker stage reads of a speech request (GenerationParams' fields of the same
    names): the chat prompt's ids and visual grids, the speaker, the request's frame sampling."""

    chat_prompt: ChatPrompt | None = None
    voice: str | None = None
    speech_sampling: dict[str, float | int] = {}


class Code2WavParams(msgspec.Struct, frozen=True, tag="code2wav"):
    """A Code2Wav stage reads nothing of the request: its frames arrive on its streamed edge."""


StageParams = GenerationParams | TalkerParams | Code2WavParams


def stage_params(kind: str, params: GenerationParams) -> StageParams:
    """The part of a request's parameters a stage of `kind` reads (what its Submit carries)."""
    if kind == "talker":
        return TalkerParams(params.chat_prompt, params.voice, params.speech_sampling)
    if kind == "code2wav":
        return Code2WavParams()
    return params


class Submit(msgspec.Struct, tag=True):
    request_id: str
    params: StageParams
    # Outputs of upstream stages: stage_id -> connector descriptor (or the inline tensor when
    # no connector is configured for that edge).
    inputs: dict[int, StageOutput] = {}
    # Connector name for this stage's own output (None: send it back inline).
    out_connector: str | None = None
    to_stage: int | None = None
    # Streamed edges (stages/streams.py): the inputs that arrive as Chunks instead of in
    # `inputs`, and whether this stage emits its output as Chunks (at most `stream_window` of
    # them not yet consumed) before its Result.
    stream_inputs: list[int] = []
    stream_output: bool = False
    stream_window: int = 0
    # A streamed edge to another stage: the consumer's edge address (its Ready's) and the
    # request's token for the edge; the consumer gets the same token per streamed input.
    # `stream_to` None with `stream_output`: the chunks go to the API server (a final stage).
    stream_to: str | None = None
    stream_token: str = ""
    stream_tokens: dict[int, str] = {}
    # Per streamed input: its producer's `stream_window` (the most chunks it may have out).
    stream_input_windows: dict[int, int] = {}


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Chunk(msgspec.Struct, tag=True):
    """One ordered piece of a final stage's output towards the API server (stages/streams.py).

    `payload` is the value inline (raw bytes or an inline tensor); the stage's Result ends the
    stream. Between two stages chunks do not travel as messages: they go over the edge's own
    channel."""

    request_id: str
    from_stage: int
    seq: int
    payload: StageOutput = None


class StreamWait(msgspec.Struct, tag=True):
    """A request in this stage waits on its peer across a streamed edge (a consumer with
    nothing to read, a producer with a full window), or no longer does: the orchestrator's
    stall clock stops for it meanwhile. Sent only once a wait lasted a pulse interval."""

    request_id: str
    stage_id: int
    waiting: bool


class Credit(msgspec.Struct, tag=True):
    """API server -> final stage: chunk `seq` of the request was consumed, so one more may be
    emitted (the producer holds at most its window of unconsumed chunks per request)."""

    request_id: str
    seq: int


class Shutdown(msgspec.Struct, tag=True):
    pass


class Inspect(msgspec.Struct, tag=True):
    """Ask a stage what it holds now (the guarded GET /v1/omni/stages?live=1). The stage answers
    with an Inspection from the loop that drives its engine, so a diffusion stage answers
    between two steps, after the Aborts that arrived before this message."""

    token: int


# ---- replies -------------------------------------------------------------------------------
class Inspection(msgspec.Struct, tag=True):
    """A stage's own view of its work, read from its engine (not the API server's bookkeeping).
    `requests`: the requests the stage holds now (a diffusion engine: waiting or running, with
    {"step", "total_steps"}; an AR stage: its running generations). `engine_unfinished`: the
    engine's own count of unfinished requests (vLLM's, for an AR stage); None if unknown.
    `submitted`: Submits this process received since it started, valid or not. `at`: when the
    stage answered (the API server's reply comes later, by however busy it is)."""

    token: int
    stage_id: int
    requests: dict[str, dict[str, int]] = {}
    engine_unfinished: int | None = None
    submitted: int = 0
    at: float = 0.0  # the stage's wall clock (time.time()) when it answered: when this was true


class Progress(msgspec.Struct, tag=True):
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


class RoleCounters(msgspec.Struct):
    """One role's (producer or consumer) transfers through a connector."""

    transfers: int
    bytes: int
    failures: int
    latency_buckets: list[int]  # counts per connectors.stats.LATENCY_BUCKETS bound, then +Inf
    latency_sum: float


class ConnectorSnapshot(msgspec.Struct):
    """Every counter of one connector in one process (connectors.stats.ConnectorStats)."""

    name: str
    puts: int
    put_bytes: int
    timeouts: int
    expired: int
    roles: dict[str, RoleCounters]


class ConnectorCounters(msgspec.Struct):
    """A stage process's connector counters, relayed to the API server's /metrics; keyed by
    the sending process (`source`) so counters stay monotonic across restarts."""

    source: str
    snapshots: list[ConnectorSnapshot]


# A request's numbers from one stage (steps, queue_s, generated_tokens, replica, ...).
StageMetrics = dict[str, int | float | str | None]


class Result(msgspec.Struct, tag=True):
    request_id: str
    # Final stages: the encoded images (or one MP4). Intermediate stages: a connector
    # descriptor, or the inline tensor.
    output: StageOutput = None
    error: str | None = None
    error_field: str | None = None  # set for request validation errors (-> HTTP 400)
    # The request failed for want of another stage's data, not by its own fault (a chunk its
    # producer could not hand over): HTTP 503, as when a stage is down.
    unavailable: bool = False
    stage_s: float = 0.0  # time the stage spent on this request, from receipt to reply
    first_output_s: float | None = None  # a streamed output: from receipt to its first chunk
    metrics: StageMetrics = {}
    connector_stats: ConnectorCounters | None = None  # this process's counters (stats_relay)


class Pulse(msgspec.Struct, tag=True):
    """A stage's engine loop made progress (a diffusion step ran, an AR engine produced
    tokens). Sent from the loop that does the work, never from a side thread, at most every
    PULSE_INTERVAL_S, and only while the stage has work: the orchestrator's stall watchdog
    (runtime.stall_timeout_s) reads work messages (Result, Progress, Pulse) as progress; this
    one keeps non-streaming requests, which get no Progress, visible to it."""

    stage_id: int


# The least time between two Pulses of one stage: a pulse per step would cost a message per
# millisecond on tiny models, while a watchdog deadline is seconds at least.
PULSE_INTERVAL_S = 0.25

# One Prometheus family: (name, type, help, [(sample name, labels, value)]).
MetricFamily = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]


class EngineMetrics(msgspec.Struct, tag=True):
    """An AR stage's own vLLM Prometheus metrics (the `vllm:` families of its process's
    registry), sent every ENGINE_METRICS_INTERVAL_S; the API server's /metrics shows them with
    the stage's labels added. Sent on a timer, so it is no sign of progress: the stall
    watchdog ignores it."""

    stage_id: int
    families: list[MetricFamily]
    # This process's connector counters. A producer learns a handoff completed only after it
    # sent that request's Result, so without this timer its counts would lag until its next
    # request.
    connector_stats: ConnectorCounters | None = None


# Staleness of the AR engines' metrics on /metrics (scrapers poll every 10-60 s).
ENGINE_METRICS_INTERVAL_S = 2.0


# ---- the stages' fork server ------------------------------------------------------------------
class ForkStage(msgspec.Struct, tag=True):
    """Fork a stage process; its control socket and the write end of its log pipe travel
    beside this message, as descriptors."""

    argv: list[str]  # stages.worker's arguments after --fd
    env: dict[str, str]
    cwd: str
    title: str  # its process title, set before Forked is sent


class ForkServerReady(msgspec.Struct, tag=True):
    pid: int


class Forked(msgspec.Struct, tag=True):
    pid: int


class StageExited(msgspec.Struct, tag=True):
    pid: int
    returncode: int  # negative: the signal that ended it, as subprocess reports it


FromForkServerMessage = ForkServerReady | Forked | StageExited
fork_request_decoder = msgspec.msgpack.Decoder(ForkStage)
fork_server_decoder = msgspec.msgpack.Decoder(FromForkServerMessage)


# ---- the unions each reader accepts, and the codec -------------------------------------------
ToStageMessage = StartStage | Submit | Abort | Inspect | Shutdown | Chunk | Credit | GenerateText
FromStageMessage = (
    Ready | Result | Progress | Pulse | Inspection | EngineMetrics | Chunk | StreamWait | TextOutput
)

_encoder = msgspec.msgpack.Encoder()
_to_stage = msgspec.msgpack.Decoder(ToStageMessage)
_from_stage = msgspec.msgpack.Decoder(FromStageMessage)

DecodeError = (msgspec.DecodeError, msgspec.ValidationError)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of one message (TypeError for a value the schema does not know)."""
    return _encoder.encode(msg)


def encode_into(msg: msgspec.Struct, buffer: bytearray, offset: int) -> None:
    """`encode(msg)` written into `buffer` from `offset` on (resized to fit): no copy of the
    encoded bytes, where a chat request's processed media make tens of MB."""
    _encoder.encode_into(msg, buffer, offset)


def decode_to_stage(data: bytes | memoryview) -> ToStageMessage:
    """A message for a stage process (DecodeError for anything else)."""
    return _to_stage.decode(data)


def decode_from_stage(data: bytes | memoryview) -> FromStageMessage:
    """A message from a stage process (DecodeError for anything else)."""
    return _from_stage.decode(data)
