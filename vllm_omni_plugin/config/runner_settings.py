"""Stages that run their own engine (the talker and Code2Wav kinds, whose settings classes list
what they read, and a third-party loop's StageSpec.settings) read only those keys: any other
key a user sets is refused at load, naming it and why the engine has no use for it (vLLM and
vLLM-Omni files set such keys routinely), so a user knows what to drop and what they lose by
dropping it."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.errors import ProblemSink
from vllm_omni_plugin.config.stage_keys import OWN_SETTINGS, route, settings_read
from vllm_omni_plugin.pipelines import StageSpec

_NO_SHARE = "it reserves no share of the GPU's memory: it allocates what its weights and batch need"
_NO_SCHEDULER = "it has no vLLM scheduler"
_GRAPH_SIZES = (
    "it takes no top-level CUDA graph sizes (the talker's vLLM engine captures the sizes its "
    "compilation_config sets; Code2Wav captures every batch size 1, 2, 4, ... up to its "
    "max_batch_size, at its two chunk lengths)"
)

# Top-level stage key -> the reason.
BY_KEY = {
    "gpu_memory_utilization": _NO_SHARE,
    "kv_cache_memory_bytes": _NO_SHARE,
    "memory_budget_gb": _NO_SHARE,
    "max_num_batched_tokens": "it has no per-step token budget",
    "enable_prefix_caching": (
        "it has no prefix cache (the talker's prompt is embeddings: its vLLM engine runs with "
        "prefix caching off)"
    ),
    "enable_chunked_prefill": "it has no chunked prefill",
    "async_scheduling": _NO_SCHEDULER,
    "scheduler_cls": _NO_SCHEDULER,
    # Code2Wav reads enforce_eager (its CUDA graphs) and none of vLLM's graph settings; the
    # talker's vLLM engine reads its compilation_config.
    "compilation_config": (
        "it is not compiled (no torch.compile; its CUDA graphs follow enforce_eager)"
    ),
    "max_cudagraph_capture_size": _GRAPH_SIZES,
    "cudagraph_capture_sizes": _GRAPH_SIZES,
    "block_size": "it has no paged KV cache",
    "kv_cache_dtype": "its KV cache is in the stage's dtype",
    "quantization": "it runs the checkpoint's weights as they are (no quantization)",
    "moe_backend": (
        "it has no MoE backend to choose (the talker's MoE layers run on vLLM's default "
        "backend for the device; Code2Wav has none)"
    ),
    "trust_remote_code": "it runs no code from the checkpoint",
    "hf_overrides": "it reads the checkpoint's config.json as it is",
    "tensor_parallel_size": "it runs on one device",
    "max_model_len": "it has no vLLM context limit",
}

# The talker runs vLLM's engine on a model of ours: the vLLM keys it refuses, and why.
BY_KEY_VLLM_RUNNER = {
    "enable_prefix_caching": "its prompt is embeddings: there is no prefix to share",
    "async_scheduling": (
        "it schedules synchronously (its model runner reads each step's codes before the next)"
    ),
    "scheduler_cls": "it runs vLLM's own scheduler",
    "hf_overrides": "the stage builds its config from the checkpoint's talker_config",
    "tensor_parallel_size": "it runs on one device",
    "trust_remote_code": "it runs no code from the checkpoint",
}

# Sampling, by the stage's kind.
SAMPLING = {
    "talker": (
        "it samples with temperature, top_k, top_p, repetition_penalty, seed and min_tokens "
        "only (a frame's other code groups follow the checkpoint's code-predictor settings)"
    ),
    "code2wav": "it decodes every frame it is given: it samples nothing and caps nothing",
}


def why_unread(path: str, kind: str) -> str:
    """The reason a runner stage of `kind` does not read `path` (a flattened stage key)."""
    if path.startswith("default_sampling_params"):
        return SAMPLING.get(kind, "it takes no sampling defaults")
    top = path.split(".")[0]
    if kind in ("talker", "ar"):
        return BY_KEY_VLLM_RUNNER.get(top, "it has no use for it")
    return BY_KEY.get(top, "it has no such setting")


# Layers a user writes (the deploy file and its platform sections, the command line,
# --stage-overrides): a stage with its own runner refuses keys set there that it does not read.
_USER_LAYERS = ("yaml", "platform", "pipeline", "cli", "stage-overrides")
# Keys every stage process honours whatever its loop (where it runs, its environment and
# watchdog, its connectors, the topology's own keys).
_EVERY_RUNNER_KEYS = ("devices", "num_replicas", "env", "stall_timeout_s")
_EVERY_RUNNER_OWNERS = ("connector", "topology")


def check_runner_settings(
    spec: StageSpec, data: dict[str, Any], prov: dict[str, str], sink: ProblemSink
) -> None:
    """A stage of a kind with its own settings, or whose runner is not its kind's engine
    (StageSpec.settings), reads only those keys: any other key a user set is refused, naming
    it; "key=value" entries also fix the value."""
    settings = stage_settings(spec)
    if settings is None:
        return
    allowed = dict(entry.partition("=")[::2] for entry in settings)
    for path, layer in sorted(prov.items()):
        if layer.split(":")[0].split("+")[0] not in _USER_LAYERS:
            continue
        top = path.split(".")[0]
        if top == "kind":  # checked against the topology (stage_build.py)
            continue
        if top in _EVERY_RUNNER_KEYS or route(top, spec.kind) in (*_EVERY_RUNNER_OWNERS, "unknown"):
            continue
        value: Any = data
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value == {}:  # an empty section sets nothing
            continue
        if path not in allowed and top not in allowed:
            sink.add(
                spec.stage_id,
                path,
                f"stage {spec.stage_id} ({spec.name}) does not read it: "
                f"{why_unread(path, spec.kind)}. It reads only {', '.join(settings)} (and "
                f"{', '.join(_EVERY_RUNNER_KEYS)}, connectors); remove it",
                unread=True,
            )
            continue
        fixed = allowed.get(path) or allowed.get(top)
        if fixed and str(value) != fixed and not _same_number(value, fixed):
            sink.add(
                spec.stage_id,
                path,
                f"is {value!r}, but stage {spec.stage_id} ({spec.name}) supports only {fixed} "
                f"here: {why_unread(path, spec.kind)}",
                unread=True,
            )


def stage_settings(spec: StageSpec) -> tuple[str, ...] | None:
    """The keys a stage reads when not every key of its kind (None: every key)."""
    if spec.settings is not None:
        return spec.settings
    return settings_read(spec.kind) if spec.kind in OWN_SETTINGS else None


def _same_number(value: Any, text: str) -> bool:
    try:
        return float(value) == float(text)
    except (TypeError, ValueError):
        return False
