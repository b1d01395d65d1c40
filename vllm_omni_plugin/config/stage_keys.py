"""Stage entry keys: flattening `engine_args:` / `runtime:` nests, aliases, and routing each key
to the typed owner that holds it (or to a warning, or to an error with a suggestion)."""

from __future__ import annotations

from typing import Any

from vllm_omni_plugin.config.errors import ProblemSink, did_you_mean
from vllm_omni_plugin.config.owners_ar import CacheOwner, SchedulerOwner
from vllm_omni_plugin.config.owners_code2wav import Code2WavSettings
from vllm_omni_plugin.config.owners_common import (
    ConnectorOwner,
    LoadOwner,
    ModelOwner,
    Owner,
    ParallelOwner,
    RuntimeOwner,
)
from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner
from vllm_omni_plugin.config.owners_talker import TalkerSamplingDefaults, TalkerSettings
from vllm_omni_plugin.config.vllm_engine_fields import VLLM_ENGINE_FIELDS

# Sections whose keys are merged into the stage (nested wins over flat, dicts deep-merge).
NESTED_SECTIONS = ("engine_args", "runtime", "parallel_config", "model_config", "engine_extras")

# Graph and worker wiring vLLM-Omni kept per stage; our frozen topology owns these.
TOPOLOGY_OWNED = frozenset(
    {
        "stage_type",
        "engine_input_source",
        "final_output",
        "final_output_type",
        "is_comprehension",
        "custom_process_input_func",
        "custom_process_next_stage_input_func",
        "worker_cls",
        "worker_type",
        "model_stage",
        "model_arch",
        "engine_output_type",
        "hf_config_name",
        "requires_multimodal_data",
        "process",
        "num_gpus",
        "prompt_transform_func",
        "owns_tokenizer",
        "model_loaded",
    }
)

# Renamed keys: vLLM-Omni / legacy name -> our name.
ALIASES = {"model_class_name": "pipeline_class", "replicas": "num_replicas"}

AR_OWNERS: dict[str, type[Owner]] = {
    "model": ModelOwner,
    "load": LoadOwner,
    "cache": CacheOwner,
    "scheduler": SchedulerOwner,
    "parallel": ParallelOwner,
    "connector": ConnectorOwner,
    "runtime": RuntimeOwner,
}
DIFFUSION_OWNERS: dict[str, type[Owner]] = {
    "diffusion": DiffusionOwner,
    "model": ModelOwner,
    "load": LoadOwner,
    "parallel": ParallelOwner,
    "connector": ConnectorOwner,
    "runtime": RuntimeOwner,
}
# Fields of the shared owners that a diffusion stage does not use (vLLM-engine only).
_AR_ONLY = frozenset(
    {
        "tokenizer",
        "tokenizer_subdir",
        "hf_overrides",
        "quantization",
        "tokenizer_mode",
        "skip_tokenizer_init",
        "max_model_len",
        "seed",
        "config_format",
        "pipeline_parallel_size",
        "data_parallel_size",
        "enable_expert_parallel",
        "compilation_config",
        "kv_transfer_config",
    }
)


def _owner_map(owners: dict[str, type[Owner]], skip: frozenset[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, cls in owners.items():
        for field in cls.model_fields:
            if field not in skip:
                out.setdefault(field, name)
    return out


AR_FIELDS = _owner_map(AR_OWNERS, frozenset())
DIFFUSION_FIELDS = _owner_map(DIFFUSION_OWNERS, _AR_ONLY)
SPECIAL = frozenset(
    {"stage_id", "kind", "default_sampling_params", "max_batch_size", "pipeline_class"}
)

# Stage kinds that run an engine of their own read only their settings class, the keys every
# stage process honours (where it runs, its environment and watchdog, its connectors) and the
# topology's own keys; loading refuses any other key set on them, naming it
# (config/runner_settings.py).
OWN_SETTINGS: dict[str, tuple[str, type[Owner]]] = {
    "talker": ("talker", TalkerSettings),
    "code2wav": ("code2wav", Code2WavSettings),
}
# Sampling defaults of those kinds (None: the kind samples nothing).
OWN_SAMPLING: dict[str, type[Owner] | None] = {
    "talker": TalkerSamplingDefaults,
    "code2wav": None,
}
# vLLM-Omni's names of a kind's settings -> ours.
KIND_ALIASES: dict[str, dict[str, str]] = {"code2wav": {"max_num_seqs": "max_batch_size"}}
EVERY_STAGE_FIELDS = {
    "devices": "runtime",
    "num_replicas": "runtime",
    "env": "runtime",
    "stall_timeout_s": "runtime",
    "input_connectors": "connector",
    "output_connectors": "connector",
    "omni_kv_config": "connector",
    "stream_nixl_min_bytes": "connector",
}
OWN_KIND_OWNERS: dict[str, dict[str, type[Owner]]] = {
    kind: {name: cls, "connector": ConnectorOwner, "runtime": RuntimeOwner}
    for kind, (name, cls) in OWN_SETTINGS.items()
}
# The kind whose keys a deploy file (or vLLM-Omni's) sets on such a stage: they are refused as
# keys the stage does not read, never as unknown keys.
_KEYS_LIKE = {"talker": "ar", "code2wav": "diffusion"}


def owners_of(kind: str) -> dict[str, type[Owner]]:
    """The owners a stage of `kind` is built from."""
    if kind in OWN_KIND_OWNERS:
        return OWN_KIND_OWNERS[kind]
    return AR_OWNERS if kind == "ar" else DIFFUSION_OWNERS


def settings_read(kind: str) -> tuple[str, ...]:
    """The keys a stage kind with its own settings reads (dotted for sampling defaults)."""
    _, cls = OWN_SETTINGS[kind]
    keys = list(cls.model_fields) + list(KIND_ALIASES.get(kind, {}))
    sampling = OWN_SAMPLING[kind]
    if sampling is not None:
        keys += [f"default_sampling_params.{f}" for f in sampling.model_fields]
    return tuple(keys)


def flatten_stage(entry: dict[str, Any], stage_id: int | None, sink: ProblemSink) -> dict[str, Any]:
    """One stage entry with its nested sections merged in and aliases renamed."""
    flat: dict[str, Any] = {}
    nested: list[tuple[str, dict[str, Any]]] = []
    for key, value in entry.items():
        if key in NESTED_SECTIONS:
            if value is None:
                continue
            if not isinstance(value, dict):
                sink.add(stage_id, key, f"must be a mapping, got {type(value).__name__}")
                continue
            nested.append((key, value))
        else:
            flat[ALIASES.get(key, key)] = value
    for _, section in nested:
        for key, value in section.items():
            key = ALIASES.get(key, key)
            if isinstance(value, dict) and isinstance(flat.get(key), dict):
                flat[key] = deep_merge(flat[key], value)
            else:
                flat[key] = value
    return flat


def deep_merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "omni_kv_config":
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def route(key: str, kind: str) -> str:
    """Where a flat stage key goes: an owner name, or "special", "topology", "vllm-extra",
    "ignored" (a vLLM engine knob a diffusion stage does not use), "unread" (a key a stage
    kind with its own settings does not read), or "unknown"."""
    if kind in OWN_SETTINGS:
        return _route_own(key, kind)
    fields = AR_FIELDS if kind == "ar" else DIFFUSION_FIELDS
    if key in SPECIAL:
        return "special"
    if key in fields:
        return fields[key]
    if key in TOPOLOGY_OWNED:
        return "topology"
    if kind == "ar" and key in VLLM_ENGINE_FIELDS:
        return "vllm-extra"
    if kind == "diffusion" and (key in VLLM_ENGINE_FIELDS or key in AR_FIELDS):
        return "ignored"
    return "unknown"


def _route_own(key: str, kind: str) -> str:
    name, cls = OWN_SETTINGS[kind]
    if key in cls.model_fields or key in KIND_ALIASES.get(kind, {}):
        return name
    if key in SPECIAL:
        return "special"
    if key in EVERY_STAGE_FIELDS:
        return EVERY_STAGE_FIELDS[key]
    where = route(key, _KEYS_LIKE[kind])
    if where in ("topology", "ignored", "unknown"):
        return where
    return "unread"


def unknown_key_message(key: str, kind: str) -> str:
    if kind in OWN_SETTINGS:
        candidates = set(settings_read(kind)) | set(EVERY_STAGE_FIELDS) | SPECIAL
        return f"unknown key for a {kind} stage{did_you_mean(key, candidates)}"
    fields = AR_FIELDS if kind == "ar" else DIFFUSION_FIELDS
    candidates = (
        set(fields) | SPECIAL | set(ALIASES) | set(NESTED_SECTIONS) | set(VLLM_ENGINE_FIELDS)
    )
    what = "an AR (vLLM engine)" if kind == "ar" else "a diffusion"
    return f"unknown key for {what} stage{did_you_mean(key, candidates)}"
