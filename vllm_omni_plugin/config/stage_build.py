"""Turning one stage's merged layers into a typed, validated StageConfig."""

from __future__ import annotations

import posixpath
from typing import Any

from pydantic import ValidationError

from vllm_omni_plugin.config.deploy import StageConfig
from vllm_omni_plugin.config.errors import ProblemSink, did_you_mean
from vllm_omni_plugin.config.family_defaults import check_family_defaults
from vllm_omni_plugin.config.owners_ar import (
    CHAT_STAGE_DEFAULTS,
    VLLM_SAMPLING_EXTRA,
    ARSamplingDefaults,
)
from vllm_omni_plugin.config.owners_common import ModelOwner, Owner, ServingLimits
from vllm_omni_plugin.config.owners_diffusion import DiffusionSamplingDefaults
from vllm_omni_plugin.config.provenance import Layered
from vllm_omni_plugin.config.runner_settings import (
    check_runner_settings,
    stage_settings,
    why_unread,
)
from vllm_omni_plugin.config.scheduler import SchedulerPairError, resolve_scheduler
from vllm_omni_plugin.config.stage_keys import (
    KIND_ALIASES,
    OWN_SAMPLING,
    OWN_SETTINGS,
    owners_of,
    route,
    unknown_key_message,
)
from vllm_omni_plugin.config.vllm_engine_fields import VLLM_ENGINE_FIELDS
from vllm_omni_plugin.pipelines import PipelineTopology, StageSpec
from vllm_omni_plugin.pipelines.registry import diffusers_class_of

_COARSE = {"bool": bool, "int": int, "float": (int, float), "str": str, "dict": dict, "list": list}


def build_stage(
    spec: StageSpec,
    topo: PipelineTopology,
    layered: Layered,
    pipeline_model: str | None,
    serving: ServingLimits,
    sink: ProblemSink,
    warnings: list[str],
) -> StageConfig | None:
    sid, kind = spec.stage_id, spec.kind
    data, prov = layered.data, layered.provenance
    owners_cls = owners_of(kind)
    aliases = KIND_ALIASES.get(kind, {})
    buckets: dict[str, dict[str, Any]] = {name: {} for name in owners_cls}
    extras: dict[str, Any] = {}
    ignored_topology, ignored_vllm, unread = [], [], []
    before = len(sink.problems)
    for key, value in data.items():
        where = route(key, kind)
        if where in buckets:
            if key in aliases:  # the key of its own name wins over vLLM-Omni's
                if aliases[key] not in data:
                    buckets[where][aliases[key]] = value
                    prov[aliases[key]] = prov.pop(key, "yaml")
                continue
            buckets[where][key] = value
        elif where == "unread":
            unread.append(key)
        elif where == "vllm-extra":
            if _coarse_ok(VLLM_ENGINE_FIELDS[key], value):
                extras[key] = value
            else:
                sink.add(sid, key, f"expected {VLLM_ENGINE_FIELDS[key]}, got {value!r}")
        elif where == "topology":
            ignored_topology.append(key)
        elif where == "ignored" and key != "max_num_seqs":  # max_num_seqs: see below
            ignored_vllm.append(key)
        elif where == "unknown":
            sink.add(sid, key, unknown_key_message(key, kind))
    _check_topology_keys(spec, topo, data, sink)
    check_runner_settings(spec, data, prov, sink)
    named = {p.field.split(".")[0] for p in sink.problems[before:]}
    for key in sorted(set(unread) - named):  # set by a layer no user writes
        sink.add(sid, key, f"stage {sid} ({spec.name}) does not read it: {why_unread(key, kind)}")
    if stage_settings(spec) is not None and len(sink.problems) > before:
        return None  # the refusals name each key; the owners would only repeat them
    if topo.chat_stage == sid:
        _check_chat_defaults(spec, data, sink)
    if ignored_topology:
        warnings.append(
            f"stage {sid}: ignored {', '.join(sorted(ignored_topology))}: pipeline "
            f"{topo.key!r} fixes the stage graph and workers in code"
        )
    if ignored_vllm:
        warnings.append(
            f"stage {sid}: ignored vLLM engine settings a diffusion stage does not use: "
            f"{', '.join(sorted(ignored_vllm))}"
        )

    if kind == "diffusion":
        diff = buckets["diffusion"]
        if "max_batch_size" in data:
            diff["max_batch_size"] = data["max_batch_size"]
        elif "max_num_seqs" in data:  # vLLM-Omni sizes diffusion batches with max_num_seqs
            diff["max_batch_size"] = data["max_num_seqs"]
            prov["max_batch_size"] = prov.pop("max_num_seqs", "yaml")
        if spec.pipeline_class:
            if data.get("pipeline_class") not in (None, spec.pipeline_class):
                warnings.append(
                    f"stage {sid}: ignored pipeline_class {data['pipeline_class']}: "
                    f"pipeline {topo.key!r} runs {spec.pipeline_class}"
                )
            diff["pipeline_class"] = spec.pipeline_class
            prov["pipeline_class"] = "topology"
        elif data.get("pipeline_class"):
            diff["pipeline_class"] = data["pipeline_class"]
        if "size_granularity" not in diff:
            diff["size_granularity"] = topo.size_granularity
            prov["size_granularity"] = "topology"
    elif kind == "ar" and "max_batch_size" in data:  # legacy runtime.max_batch_size
        buckets["scheduler"].setdefault("max_num_seqs", data["max_batch_size"])
        prov.setdefault("max_num_seqs", prov.pop("max_batch_size", "yaml"))

    owners = {name: _build(cls, buckets[name], sid, sink) for name, cls in owners_cls.items()}
    sampling = _build_sampling(kind, data.get("default_sampling_params"), sid, sink)
    samples = OWN_SAMPLING.get(kind, True) is not None
    if (
        len(sink.problems) > before
        or any(o is None for o in owners.values())
        or (sampling is None and samples)
    ):
        return None

    if kind in OWN_SETTINGS:
        _check_talker(owners.get("talker"), sampling, sid, sink)
    elif kind == "ar":
        owners["scheduler"] = _pair_scheduler(owners["scheduler"], prov, sid, sink)
        if owners["scheduler"] is None:
            return None
        _check_ar(owners, sampling, sid, sink)
    else:
        _check_diffusion(owners["diffusion"], sampling, sid, sink)
        _check_diffusion_ranks(owners["diffusion"], owners["runtime"], sid, sink)
    _check_without_effect(owners, kind, sid, sink, warnings, stage_settings(spec) or ())
    if len(sink.problems) > before:
        return None

    model_path, tokenizer_path = _model_paths(
        spec, owners.get("model") or ModelOwner(), pipeline_model
    )
    prov["model_path"] = prov.get("model", "topology" if pipeline_model else "default")
    diffusion = owners.get("diffusion")
    if diffusion is not None and diffusion.pipeline_class is None and model_path:
        found = diffusers_class_of(model_path)
        if found:
            diffusion = diffusion.model_copy(update={"pipeline_class": found})
            prov["pipeline_class"] = "derived:model_index.json"
    if diffusion is not None:
        check_family_defaults(diffusion.pipeline_class, model_path, sampling, sid, sink)
        if len(sink.problems) > before:
            return None
    _fill_default_provenance(owners, sampling, prov)
    return StageConfig(
        stage_id=sid,
        name=spec.name,
        kind=kind,
        inputs=list(spec.inputs),
        emits=spec.emits,
        final_output=spec.final_output,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        pipeline_model_path=pipeline_model,
        model=owners.get("model"),
        load=owners.get("load"),
        parallel=owners.get("parallel"),
        connector=owners["connector"],
        runtime=owners["runtime"],
        sampling=sampling,
        cache=owners.get("cache"),
        scheduler=owners.get("scheduler"),
        diffusion=diffusion,
        talker=owners.get("talker"),
        code2wav=owners.get("code2wav"),
        engine_extras=extras,
        serving=serving,
        provenance=dict(prov),
    )


def _coarse_ok(tag: str, value: Any) -> bool:
    if value is None or tag == "any":
        return True
    if tag in ("int", "float") and isinstance(value, bool):
        return False
    return isinstance(value, _COARSE[tag])


def _build(cls: type[Owner], values: dict[str, Any], sid: int, sink: ProblemSink) -> Any:
    try:
        return cls(**values)
    except ValidationError as exc:
        _report(exc, sid, sink, prefix="")
        return None


def _report(exc: ValidationError, sid: int, sink: ProblemSink, prefix: str, fields=()) -> None:
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + did_you_mean(str(err["loc"][-1]), fields)
        elif "input" in err and err["type"] != "value_error":
            msg = f"{msg} (got {err['input']!r})"
        msg = msg.replace("Value error, ", "")
        sink.add(sid, prefix + loc if loc else prefix.rstrip("."), msg)


def _build_sampling(kind: str, raw: Any, sid: int, sink: ProblemSink) -> Any:
    if kind in OWN_SAMPLING:
        cls = OWN_SAMPLING[kind]
        if cls is None:
            return None  # any default_sampling_params key was refused as unread
    else:
        cls = ARSamplingDefaults if kind == "ar" else DiffusionSamplingDefaults
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        sink.add(sid, "default_sampling_params", "must be a mapping")
        return None
    values = dict(raw)
    if kind == "ar":
        extra = {
            k: values.pop(k)
            for k in list(values)
            if k in VLLM_SAMPLING_EXTRA and k not in cls.model_fields
        }
        values["extra"] = extra
    try:
        return cls(**values)
    except ValidationError as exc:
        fields = set(cls.model_fields) | (VLLM_SAMPLING_EXTRA if kind == "ar" else set())
        _report(exc, sid, sink, "default_sampling_params.", fields)
        return None


# vLLM-Omni's stage_type of each kind (it runs the talker and Code2Wav as "llm" stages).
_STAGE_TYPES = {
    "ar": ("llm",),
    "diffusion": ("diffusion",),
    "talker": ("llm",),
    "code2wav": ("llm", "diffusion"),
}
_KIND_WORDS = {
    "ar": "an AR (llm)",
    "diffusion": "a diffusion",
    "talker": "a talker",
    "code2wav": "a code2wav",
}


def _check_topology_keys(
    spec: StageSpec, topo: PipelineTopology, data: dict[str, Any], sink: ProblemSink
) -> None:
    """Topology-owned keys are ignored, unless they contradict the frozen topology."""
    kind = data.get("kind")
    if kind is not None and kind != spec.kind:
        sink.add(
            spec.stage_id,
            "kind",
            f"is {kind!r} but stage {spec.stage_id} ({spec.name}) of pipeline {topo.key!r} "
            f"is of kind {spec.kind!r}",
        )
    stage_type = data.get("stage_type")
    if stage_type is not None:
        expected = _STAGE_TYPES[spec.kind]
        if stage_type not in (*expected, spec.kind):
            sink.add(
                spec.stage_id,
                "stage_type",
                f"is {stage_type!r} but this pipeline's stage {spec.stage_id} ({spec.name}) is "
                f"{_KIND_WORDS[spec.kind]} stage",
            )
    if data.get("final_output") not in (None, spec.final_output):
        sink.add(
            spec.stage_id,
            "final_output",
            f"is {data['final_output']} but stage {spec.stage_id} ({spec.name}) "
            f"{'is' if spec.final_output else 'is not'} the final output of this pipeline",
        )


def _check_chat_defaults(spec: StageSpec, data: dict[str, Any], sink: ProblemSink) -> None:
    """A chat stage's requests are built by vLLM's own handlers, which take only some defaults
    (CHAT_STAGE_DEFAULTS, applied through override_generation_config): refuse the others."""
    sampling = data.get("default_sampling_params")
    if not isinstance(sampling, dict):
        return
    for key in sorted(set(sampling) - set(CHAT_STAGE_DEFAULTS)):
        sink.add(
            spec.stage_id,
            f"default_sampling_params.{key}",
            f"stage {spec.stage_id} ({spec.name}) answers chat through vLLM's own handlers, "
            f"whose defaults can be only {', '.join(CHAT_STAGE_DEFAULTS)}; send {key} per "
            "request or remove it",
        )


def _pair_scheduler(owner: Any, prov: dict[str, str], sid: int, sink: ProblemSink) -> Any:
    try:
        cls, is_async, derived = resolve_scheduler(owner.scheduler_cls, owner.async_scheduling)
    except SchedulerPairError as exc:
        sink.add(sid, "scheduler_cls", str(exc))
        return None
    if derived == "cls":
        prov["scheduler_cls"] = (
            "derived:async_scheduling" if "async_scheduling" in prov else "default"
        )
    elif derived == "async":
        prov["async_scheduling"] = "derived:scheduler_cls"
    # The pair is always written explicitly: downstream never re-derives it.
    return owner.model_copy(update={"scheduler_cls": cls, "async_scheduling": is_async})


def _check_talker(talker: Any, sampling: Any, sid: int, sink: ProblemSink) -> None:
    if talker is None or sampling is None:
        return
    if talker.max_model_len and sampling.max_tokens and sampling.max_tokens > talker.max_model_len:
        sink.add(
            sid,
            "default_sampling_params.max_tokens",
            f"{sampling.max_tokens} exceeds max_model_len {talker.max_model_len}",
        )


def _check_ar(owners: dict[str, Any], sampling: Any, sid: int, sink: ProblemSink) -> None:
    par, runtime, model = owners["parallel"], owners["runtime"], owners["model"]
    needed = par.tensor_parallel_size * par.pipeline_parallel_size
    if runtime.device_count is not None and needed > runtime.device_count:
        sink.add(
            sid,
            "tensor_parallel_size",
            f"{par.tensor_parallel_size} x pipeline_parallel_size {par.pipeline_parallel_size} "
            f"needs {needed} devices but devices {runtime.devices!r} lists {runtime.device_count}",
        )
    if model.max_model_len and sampling.max_tokens and sampling.max_tokens > model.max_model_len:
        sink.add(
            sid,
            "default_sampling_params.max_tokens",
            f"{sampling.max_tokens} exceeds max_model_len {model.max_model_len}",
        )


# Fields that have no runtime effect yet. A value that would ask for behaviour the plugin does
# not have is refused (a deploy that silently runs differently from its file is the failure this
# project exists to prevent); a value that changes nothing when ignored (vLLM-Omni files set them
# routinely) is warned about, naming the field. config/consumers.py lists every field's fate.
# (num_replicas: config/pipeline_runtime.py, which knows the pipeline's backend.)
_REFUSED_ABOVE_ONE = {
    "parallel": (
        "sequence_parallel_size",
        "ulysses_degree",
        "ring_degree",
        "cfg_parallel_size",
        "vae_patch_parallel_size",
    ),
}
_REFUSED_ABOVE_ONE_DIFFUSION = {"parallel": ("tensor_parallel_size",)}
_WARNED_IF_SET = {"runtime": ("async_chunk",), "connector": ("omni_kv_config",)}
_WARNED_IF_SET_DIFFUSION = {
    "model": ("trust_remote_code", "revision"),
    "load": ("load_format", "download_dir"),
    "parallel": ("distributed_executor_backend",),
    "runtime": ("enforce_eager",),
}
_WHY_ONE = {
    "tensor_parallel_size": "a diffusion stage runs on one device",
}


def _check_without_effect(
    owners: dict[str, Any],
    kind: str,
    sid: int,
    sink: ProblemSink,
    warnings: list[str],
    read: tuple[str, ...] = (),
) -> None:
    """`read`: the keys a stage with its own runner reads (StageSpec.settings): never warned
    about as having no effect."""
    refused = [_REFUSED_ABOVE_ONE] + ([_REFUSED_ABOVE_ONE_DIFFUSION] if kind == "diffusion" else [])
    warned = [_WARNED_IF_SET] + ([_WARNED_IF_SET_DIFFUSION] if kind == "diffusion" else [])
    for owner_name, name in ((o, n) for table in refused for o, ns in table.items() for n in ns):
        value = getattr(owners.get(owner_name), name, None)
        if value is not None and value > 1:
            why = _WHY_ONE.get(name, "this parallelism is not implemented yet")
            sink.add(sid, name, f"{value} is not supported: {why}; set 1 or remove it")
    for owner_name, name in ((o, n) for table in warned for o, ns in table.items() for n in ns):
        owner = owners.get(owner_name)
        if owner is not None and name in owner.model_fields_set and name not in read:
            what = "an AR" if kind == "ar" else f"a {kind}"
            warnings.append(
                f"stage {sid}: {name} has no effect on {what} stage of this plugin "
                "(accepted for vLLM-Omni files); remove it"
            )
    diff = owners.get("diffusion")
    for name in ("cache_backend", "cache_config"):
        if diff is not None and getattr(diff, name) is not None:
            sink.add(
                sid,
                name,
                "vLLM-Omni's cache backends are not used here; set `step_cache` instead "
                "(policies: [first_block, teacache, taylorseer], default: {policy: teacache, "
                "threshold: 0.2})",
            )
    if diff is not None and diff.enable_cpu_offload:
        sink.add(
            sid,
            "enable_cpu_offload",
            "CPU offload is not implemented: the whole pipeline stays on the device; "
            "set false or remove it",
        )


def _check_diffusion_ranks(diff: Any, runtime: Any, sid: int, sink: ProblemSink) -> None:
    """cfg_parallel / ulysses_degree start one rank per device: on a GPU the stage's `devices`
    must list at least that many (gloo ranks on device: cpu need none)."""
    world = (2 if diff.cfg_parallel else 1) * diff.ulysses_degree
    if world == 1 or diff.device == "cpu":
        return
    field = "ulysses_degree" if diff.ulysses_degree > 1 else "cfg_parallel"
    if runtime.device_count is None or runtime.device_count < world:
        listed = f"lists {runtime.device_count}" if runtime.devices else "is not set"
        sink.add(
            sid,
            field,
            f"cfg_parallel={diff.cfg_parallel} x ulysses_degree={diff.ulysses_degree} needs "
            f"{world} devices (one rank each) but devices {listed}; list {world} GPUs in "
            "`devices` or run on device: cpu",
        )


def _check_diffusion(diff: Any, sampling: Any, sid: int, sink: ProblemSink) -> None:
    steps = sampling.num_inference_steps
    if steps is not None and steps > diff.max_num_inference_steps:
        sink.add(
            sid,
            "default_sampling_params.num_inference_steps",
            f"{steps} exceeds max_num_inference_steps {diff.max_num_inference_steps}",
        )
    for dim in ("height", "width"):
        value = getattr(sampling, dim)
        lo, hi = getattr(diff, f"min_{dim}"), getattr(diff, f"max_{dim}")
        if value is None:
            continue
        if not lo <= value <= hi:
            sink.add(
                sid,
                f"default_sampling_params.{dim}",
                f"{value} is outside [{lo}, {hi}] (min_{dim}/max_{dim})",
            )
        elif diff.size_granularity and value % diff.size_granularity:
            sink.add(
                sid,
                f"default_sampling_params.{dim}",
                f"{value} is not a multiple of {diff.size_granularity}",
            )


def _model_paths(
    spec: StageSpec, model: Any, pipeline_model: str | None
) -> tuple[str | None, str | None]:
    """Own `model` / `model_subdir` first, else the pipeline model + the topology's subfolder."""
    own = model.model
    subdir = (
        model.model_subdir
        if model.model_subdir is not None
        else (None if own else spec.model_subdir)
    )
    root = own or pipeline_model
    model_path = _join(root, subdir) if root else None
    if spec.kind != "ar":
        return model_path, None
    if model.tokenizer:
        return model_path, model.tokenizer
    tok_sub = (
        model.tokenizer_subdir
        if model.tokenizer_subdir is not None
        else (None if own else spec.tokenizer_subdir)
    )
    return model_path, (_join(root, tok_sub) if root and tok_sub else None)


def _join(root: str, sub: str | None) -> str:
    return posixpath.join(root.rstrip("/"), sub) if sub else root


def _fill_default_provenance(owners: dict[str, Any], sampling: Any, prov: dict[str, str]) -> None:
    for owner in owners.values():
        for key in type(owner).model_fields:
            if not any(k == key or k.startswith(key + ".") for k in prov):
                prov[key] = "default"
    for key, value in (sampling.model_dump() if sampling is not None else {}).items():
        path = f"default_sampling_params.{key}"
        if value is not None and not any(k == path or k.startswith(path + ".") for k in prov):
            prov[path] = "default"
