"""Where every field of every config owner takes effect, or how loading rejects it.

A field accepted and then ignored is the defect this project exists to end, so each field has a
fate here, per stage kind, and tests/config/test_field_consumers.py checks every entry against
the code: a consumer file must exist and name the field, an engine argument must be one vLLM's
engine takes, a refused example must fail loading naming the field, a warned example must load
with a warning naming it. A field added to an owner without an entry fails that test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Code:
    """Read by our code: `path` (relative to the package) names the field (or `token`)."""

    path: str
    token: str | None = None


@dataclass(frozen=True)
class EngineArg:
    """Handed to the AR stage's vLLM engine (`StageConfig.engine_kwargs`)."""


@dataclass(frozen=True)
class Refused:
    """Loading refuses `example` (and values like it) naming the field; other values act or
    are the only behaviour there is (e.g. num_replicas: 1). `unless`: the setting under which
    the refused value is accepted and acts instead, and the code that acts on it."""

    example: Any
    unless: tuple[str, Code] | None = None


@dataclass(frozen=True)
class Warned:
    """Kept only so vLLM-Omni files load: setting it warns at load that it has no effect."""

    example: Any


Fate = Code | EngineArg | Refused | Warned

_STAGE_FILE = "config/stage_build.py"  # model paths are resolved there
_ENV = "orchestrator/stage_process.py"  # the stage process's environment is built there
_EDGES = "config/connectors_cfg.py"
_ENGINE = "diffusion/engine.py"
_LIMITS = "serving/protocol.py"
_RAY = "orchestrator/ray_backend.py"


def _both(fate: Fate) -> dict[str, Fate]:
    return {"ar": fate, "diffusion": fate}


def _every(fate: Fate) -> dict[str, Fate]:
    """Fields every stage process reads, whatever its kind (where it runs, its connectors)."""
    return {"ar": fate, "diffusion": fate, "talker": fate, "code2wav": fate}


# (owner class name, field) -> {stage kind ("ar", "diffusion", "talker", "code2wav") or
# "pipeline": fate}. Kinds a field does not apply to (AR-only fields on a diffusion stage, which
# loading already warns about as "vLLM engine settings a diffusion stage does not use"; any
# field but its own on a talker or Code2Wav stage, which loading refuses naming it) are left out.
CONSUMERS: dict[tuple[str, str], dict[str, Fate]] = {
    # ModelOwner
    ("ModelOwner", "model"): _both(Code(_STAGE_FILE)),
    ("ModelOwner", "model_subdir"): _both(Code(_STAGE_FILE)),
    ("ModelOwner", "tokenizer"): {"ar": Code(_STAGE_FILE)},
    ("ModelOwner", "tokenizer_subdir"): {"ar": Code(_STAGE_FILE)},
    ("ModelOwner", "trust_remote_code"): {"ar": EngineArg(), "diffusion": Warned(True)},
    ("ModelOwner", "revision"): {"ar": EngineArg(), "diffusion": Warned("main")},
    ("ModelOwner", "hf_overrides"): {"ar": EngineArg()},
    ("ModelOwner", "quantization"): {"ar": EngineArg()},
    ("ModelOwner", "tokenizer_mode"): {"ar": EngineArg()},
    ("ModelOwner", "skip_tokenizer_init"): {"ar": EngineArg()},
    ("ModelOwner", "max_model_len"): {"ar": EngineArg()},
    ("ModelOwner", "dtype"): {"ar": EngineArg()},  # a diffusion stage's dtype is DiffusionOwner's
    ("ModelOwner", "seed"): {"ar": EngineArg()},
    # LoadOwner
    ("LoadOwner", "load_format"): {"ar": EngineArg(), "diffusion": Warned("safetensors")},
    ("LoadOwner", "download_dir"): {"ar": EngineArg(), "diffusion": Warned("/tmp/hub")},
    ("LoadOwner", "config_format"): {"ar": EngineArg()},
    # ParallelOwner
    ("ParallelOwner", "tensor_parallel_size"): {"ar": EngineArg(), "diffusion": Refused(2)},
    ("ParallelOwner", "pipeline_parallel_size"): {"ar": EngineArg()},
    ("ParallelOwner", "data_parallel_size"): {"ar": EngineArg()},
    ("ParallelOwner", "distributed_executor_backend"): {
        "ar": EngineArg(),
        "diffusion": Warned("mp"),
    },
    ("ParallelOwner", "enable_expert_parallel"): {"ar": EngineArg()},
    ("ParallelOwner", "sequence_parallel_size"): _both(Refused(2)),
    # A diffusion stage's ulysses_degree is DiffusionOwner's (routed there first, stage_keys.py).
    ("ParallelOwner", "ulysses_degree"): {"ar": Refused(2)},
    ("ParallelOwner", "ring_degree"): _both(Refused(2)),
    ("ParallelOwner", "cfg_parallel_size"): _both(Refused(2)),
    ("ParallelOwner", "vae_patch_parallel_size"): _both(Refused(2)),
    # ConnectorOwner
    ("ConnectorOwner", "input_connectors"): _every(Code(_EDGES)),
    ("ConnectorOwner", "output_connectors"): _every(Code(_EDGES)),
    ("ConnectorOwner", "omni_kv_config"): _every(Warned({"need_send_cache": True})),
    ("ConnectorOwner", "kv_transfer_config"): {"ar": EngineArg()},
    ("ConnectorOwner", "stream_nixl_min_bytes"): _every(Code("stages/loop.py")),
    # RuntimeOwner
    ("RuntimeOwner", "devices"): _every(Code(_ENV)),
    ("RuntimeOwner", "num_replicas"): _every(
        Refused(2, unless=("runtime: {backend: ray}", Code(_RAY)))
    ),
    ("RuntimeOwner", "env"): _every(Code(_ENV)),
    ("RuntimeOwner", "enforce_eager"): {"ar": EngineArg(), "diffusion": Warned(True)},
    ("RuntimeOwner", "compilation_config"): {"ar": EngineArg()},
    ("RuntimeOwner", "async_chunk"): _both(Warned(True)),
    ("RuntimeOwner", "stall_timeout_s"): _every(Code("orchestrator/stage_client.py")),
    # CacheOwner, SchedulerOwner: vLLM's own engine settings
    **{
        ("CacheOwner", f): {"ar": EngineArg()}
        for f in (
            "gpu_memory_utilization",
            "kv_cache_memory_bytes",
            "enable_prefix_caching",
            "block_size",
            "kv_cache_dtype",
        )
    },
    **{
        ("SchedulerOwner", f): {"ar": EngineArg()}
        for f in (
            "scheduler_cls",
            "async_scheduling",
            "max_num_seqs",
            "max_num_batched_tokens",
            "enable_chunked_prefill",
        )
    },
    # ARSamplingDefaults: every field becomes a vllm.SamplingParams argument in the AR glue
    **{
        ("ARSamplingDefaults", f): {"ar": Code("config/owners_ar.py", "sampling_kwargs")}
        for f in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "max_tokens",
            "min_tokens",
            "stop_token_ids",
            "seed",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "extra",
        )
    },
    # TalkerSettings: the talker's vLLM engine arguments (StageConfig.engine_kwargs)
    **{
        ("TalkerSettings", f): {"talker": EngineArg()}
        for f in (
            "dtype",
            "seed",
            "max_num_seqs",
            "max_model_len",
            "max_num_batched_tokens",
            "enable_chunked_prefill",
            "async_scheduling",
            "gpu_memory_utilization",
            "kv_cache_memory_bytes",
            "block_size",
            "enforce_eager",
            "compilation_config",
            "max_cudagraph_capture_size",
            "cudagraph_capture_sizes",
        )
    },
    # TalkerSamplingDefaults: each frame's sampling (the frame cap bounds the talker's lengths)
    **{
        ("TalkerSamplingDefaults", f): {"talker": Code("stages/qwen3_omni.py")}
        for f in ("min_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed")
    },
    ("TalkerSamplingDefaults", "max_tokens"): {"talker": Code("pipelines/qwen3_omni.py")},
    # Code2WavSettings: the Code2Wav engine's config, built by its stage
    **{
        ("Code2WavSettings", f): {"code2wav": Code("stages/qwen3_omni.py")}
        for f in ("device", "dtype", "max_batch_size", "enforce_eager")
    },
    # The memory budget is planned in its own module (requests are admitted against it).
    **{
        ("DiffusionOwner", f): {"diffusion": Code("diffusion/memory_plan.py")}
        for f in ("memory_budget_gb", "gpu_memory_utilization")
    },
    # DiffusionOwner: DiffusionEngineConfig.from_owner takes it whole; the engine reads each
    **{
        ("DiffusionOwner", f): {"diffusion": Code(_ENGINE)}
        for f in (
            "pipeline_class",
            "dtype",
            "device",
            "max_batch_size",
            "max_batch_tokens",
            "max_num_inference_steps",
            "min_height",
            "max_height",
            "min_width",
            "max_width",
            "size_granularity",
            "request_batch_max_wait_ms",
            "overlap_encode_decode",
            "vae_use_slicing",
            "vae_use_tiling",
            "compile_transformer",
            "compile_regional",
            "compile_dynamic",
            "compile_cache_dir",
            "cuda_graphs",
            "cuda_graph_max_graphs",
            "fuse_gelu",
            "fp8_linear",
        )
    },
    ("DiffusionOwner", "enable_cpu_offload"): {"diffusion": Refused(True)},
    # Multi-rank DiT: the stage starts that many ranks (diffusion/parallel/ranks.py).
    ("DiffusionOwner", "cfg_parallel"): {"diffusion": Code("diffusion/parallel/ranks.py")},
    ("DiffusionOwner", "ulysses_degree"): {"diffusion": Code("diffusion/parallel/ranks.py")},
    # Step caching: step_cache is the engine's (diffusion/step_cache/); vLLM-Omni's
    # cache_backend / cache_config are refused, naming step_cache.
    ("DiffusionOwner", "step_cache"): {"diffusion": Code(_ENGINE)},
    **{
        ("StepCacheOwner", f): {"diffusion": Code("diffusion/step_cache/runtime.py")}
        for f in ("policies", "max_threshold", "default")
    },
    # LoRA adapters per request (diffusion/lora/).
    ("DiffusionOwner", "lora"): {"diffusion": Code(_ENGINE)},
    **{
        ("LoraOwner", f): {"diffusion": Code("diffusion/lora/setup.py")}
        for f in ("dir", "max_loaded", "max_rank")
    },
    ("DiffusionOwner", "cache_backend"): {"diffusion": Refused("tea_cache")},
    ("DiffusionOwner", "cache_config"): {"diffusion": Refused({"rel_l1_thresh": 0.2})},
    # DiffusionSamplingDefaults: the engine's request defaults
    **{
        ("DiffusionSamplingDefaults", f): {"diffusion": Code(_ENGINE)}
        for f in (
            "num_inference_steps",
            "guidance_scale",
            "height",
            "width",
            "seed",
            "negative_prompt",
        )
    },
    ("DiffusionSamplingDefaults", "true_cfg_scale"): {
        "diffusion": Code("diffusion/adapters/qwen_image.py")
    },
    ("DiffusionSamplingDefaults", "output_type"): {"diffusion": Refused("latent")},
    ("DiffusionSamplingDefaults", "extra_args"): {"diffusion": Refused({"eta": 0.5})},
    # ServingLimits (top-level `serving:`)
    ("ServingLimits", "max_n"): {"pipeline": Code(_LIMITS)},
    ("ServingLimits", "max_prompt_chars"): {"pipeline": Code(_LIMITS)},
    ("ServingLimits", "max_negative_prompt_chars"): {"pipeline": Code(_LIMITS)},
    ("ServingLimits", "request_timeout_s"): {"pipeline": Code("serving/app_state.py")},
    ("ServingLimits", "max_queued_requests"): {"pipeline": Code("serving/app_state.py")},
    ("ServingLimits", "edit_url_hosts"): {"pipeline": Code("serving/app_state.py")},
    ("ServingLimits", "max_input_audio_s"): {"pipeline": Code("serving/media_limits.py")},
    **{
        ("ServingLimits", f): {"pipeline": Code("serving/media_limits.py")}
        for f in (
            "max_media_parts",
            "max_media_part_bytes",
            "max_input_video_frames",
            "max_input_image_pixels",
        )
    },
    # PipelineRuntime (top-level `runtime:`)
    ("PipelineRuntime", "backend"): {"pipeline": Code(_RAY)},
    ("PipelineRuntime", "address"): {"pipeline": Code(_RAY)},
    ("PipelineRuntime", "node_ip_address"): {"pipeline": Code(_RAY)},
    ("PipelineRuntime", "max_restarts"): {"pipeline": Code(_RAY)},
    # VideoJobs (top-level `videos:`): the /v1/videos job store and video request bounds
    **{
        ("VideoJobs", f): {"pipeline": Code("serving/videos_store.py")}
        for f in ("store_dir", "max_store_bytes", "max_age_s")
    },
    **{
        ("VideoJobs", f): {"pipeline": Code("serving/videos.py")}
        for f in (
            "max_running_jobs",
            "max_num_frames",
            "default_fps",
            "max_queued_jobs",
            "job_timeout_s",
            "max_event_streams",
        )
    },
}
