"""Every field of every config owner reaches code that acts on it, or loading refuses or warns
about it naming the field (config/consumers.py is the map; this checks the map against the
code). A field added without a consumer fails `test_every_field_has_a_fate`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from config_helpers import load, problems, write

import vllm_omni_plugin
from vllm_omni_plugin.config import deploy
from vllm_omni_plugin.config.consumers import CONSUMERS, Code, EngineArg, Refused, Warned
from vllm_omni_plugin.config.owners_ar import ARSamplingDefaults
from vllm_omni_plugin.config.owners_common import Owner, ServingLimits
from vllm_omni_plugin.config.owners_diffusion import (
    DiffusionSamplingDefaults,
    LoraOwner,
    StepCacheOwner,
)
from vllm_omni_plugin.config.owners_talker import TalkerSamplingDefaults, TalkerSettings
from vllm_omni_plugin.config.owners_videos import VideoJobs
from vllm_omni_plugin.config.pipeline_runtime import PipelineRuntime
from vllm_omni_plugin.config.stage_keys import (
    AR_OWNERS,
    DIFFUSION_FIELDS,
    DIFFUSION_OWNERS,
    OWN_SETTINGS,
    owners_of,
    route,
)
from vllm_omni_plugin.config.vllm_engine_fields import VLLM_ENGINE_FIELDS
from vllm_omni_plugin.diffusion.config import OWNER_FIELDS_NOT_IN_ENGINE, DiffusionEngineConfig

PACKAGE = Path(vllm_omni_plugin.__file__).parent
# glm_image has the ar and diffusion kinds: stage 0 is the AR stage, stage 1 the diffusion
# stage; qwen3_omni has the talker (stage 1) and Code2Wav (stage 2) kinds.
STAGE_OF_KIND = {"ar": 0, "diffusion": 1, "talker": 1, "code2wav": 2}
PIPELINE_OF_KIND = {
    "ar": "glm_image",
    "diffusion": "glm_image",
    "talker": "qwen3_omni",
    "code2wav": "qwen3_omni",
}


def _all_owners() -> list[type[Owner]]:
    out, todo = [], [Owner]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            out.append(sub)
            todo.append(sub)
    return sorted(set(out), key=lambda c: c.__name__)


def _kinds(owner: type[Owner], field: str) -> set[str]:
    """The stage kinds (or "pipeline") on which a field of this owner can be set."""
    if owner is VideoJobs:  # top-level `videos:`
        return {"pipeline"}
    if owner in (ServingLimits, PipelineRuntime):
        return {"pipeline"}
    if owner is ARSamplingDefaults:
        return {"ar"}
    if owner is TalkerSamplingDefaults:
        return {"talker"}
    # StepCacheOwner: `step_cache:`; LoraOwner: `lora:` (sections of a diffusion stage)
    if owner in (DiffusionSamplingDefaults, StepCacheOwner, LoraOwner):
        return {"diffusion"}
    kinds = set()
    if owner in AR_OWNERS.values():
        kinds.add("ar")
    name = next((n for n, c in DIFFUSION_OWNERS.items() if c is owner), None)
    if name is not None and DIFFUSION_FIELDS.get(field) == name:
        kinds.add("diffusion")
    for kind in OWN_SETTINGS:  # only the fields routed to the owner (the rest are refused)
        name = next((n for n, c in owners_of(kind).items() if c is owner), None)
        if name is not None and route(field, kind) == name:
            kinds.add(kind)
    return kinds


ALL_FIELDS = [(o, f) for o in _all_owners() for f in o.model_fields]


def test_every_owner_is_known():
    # A new owner class must say where its fields can be set before its fields can be mapped.
    for owner in _all_owners():
        assert any(_kinds(owner, f) for f in owner.model_fields), owner.__name__


@pytest.mark.parametrize(
    ("owner", "field"), ALL_FIELDS, ids=[f"{o.__name__}.{f}" for o, f in ALL_FIELDS]
)
def test_every_field_has_a_fate(owner, field):
    fates = CONSUMERS.get((owner.__name__, field))
    assert fates is not None, (
        f"{owner.__name__}.{field} has no consumer in config/consumers.py: wire it to the code "
        "that acts on it, or refuse/warn about it at load"
    )
    assert set(fates) == _kinds(owner, field), (owner.__name__, field, set(fates))
    for kind, fate in fates.items():
        if isinstance(fate, Code):
            path = PACKAGE / fate.path
            assert path.is_file(), f"{owner.__name__}.{field}: {fate.path} does not exist"
            token = fate.token or field
            assert token in path.read_text(), f"{fate.path} never mentions {token!r}"
        elif isinstance(fate, EngineArg):
            assert kind in ("ar", "talker")
            assert field in VLLM_ENGINE_FIELDS, f"{field} is not a vLLM engine argument"
            if kind == "ar":
                assert field not in deploy._NOT_ENGINE_ARGS, f"engine_kwargs() drops {field}"
            else:
                assert owner is TalkerSettings
        else:
            assert isinstance(fate, (Refused, Warned))


def test_no_stale_entries():
    known = {(o.__name__, f) for o, f in ALL_FIELDS}
    assert set(CONSUMERS) <= known, sorted(set(CONSUMERS) - known)


def test_diffusion_owner_reaches_the_engine_config_whole():
    # from_owner takes every DiffusionOwner field into the field of the same name, except the
    # ones loading refuses or warns about.
    from vllm_omni_plugin.config.owners_diffusion import DiffusionOwner

    slots = {f.name for f in dataclasses.fields(DiffusionEngineConfig)}
    for name in DiffusionOwner.model_fields:
        fate = CONSUMERS[("DiffusionOwner", name)]["diffusion"]
        assert (name in slots) == (name not in OWNER_FIELDS_NOT_IN_ENGINE), name
        assert (name in OWNER_FIELDS_NOT_IN_ENGINE) == isinstance(fate, (Refused, Warned)), name
    owner = DiffusionOwner(
        max_batch_size=3,
        request_batch_max_wait_ms=25,
        vae_use_tiling=True,
        gpu_memory_utilization=0.5,
        device="cpu",
    )
    ecfg = DiffusionEngineConfig.from_owner(owner, model="/m", defaults={"height": 64})
    for name, value in owner.model_dump().items():
        if name not in OWNER_FIELDS_NOT_IN_ENGINE:
            assert getattr(ecfg, name) == value, name
    assert ecfg.defaults == {"height": 64} and ecfg.model == "/m"


def _yaml_with(kind: str, field: str, value) -> str:
    """A config setting one field on the stage of `kind` (or in `serving:`)."""
    pipeline = PIPELINE_OF_KIND.get(kind, "glm_image")
    count = 3 if pipeline == "qwen3_omni" else 2
    doc: dict = {"pipeline": pipeline, "stages": [{"stage_id": i} for i in range(count)]}
    if kind == "pipeline":
        doc["serving"] = {field: value}
        return yaml.safe_dump(doc)
    stage = doc["stages"][STAGE_OF_KIND[kind]]
    if field in ARSamplingDefaults.model_fields or field in DiffusionSamplingDefaults.model_fields:
        if (kind == "ar" and field in ARSamplingDefaults.model_fields) or (
            kind == "diffusion" and field in DiffusionSamplingDefaults.model_fields
        ):
            stage["default_sampling_params"] = {field: value}
            return yaml.safe_dump(doc)
    stage[field] = value
    return yaml.safe_dump(doc)


REJECTIONS = [
    (owner, field, kind, fate)
    for (owner, field), fates in CONSUMERS.items()
    for kind, fate in fates.items()
    if isinstance(fate, (Refused, Warned))
]


@pytest.mark.parametrize(
    ("owner", "field", "kind", "fate"),
    REJECTIONS,
    ids=[f"{o}.{f}-{k}" for o, f, k, _ in REJECTIONS],
)
def test_refused_and_warned_fields_say_so_at_load(tmp_path, owner, field, kind, fate):
    text = _yaml_with(kind, field, fate.example)
    if isinstance(fate, Refused):
        lines = problems(write(tmp_path, text))
        assert any(field in line for line in lines), lines
    else:
        cfg = load(tmp_path, text)
        hits = [w for w in cfg.warnings if field in w and "no effect" in w]
        assert hits, cfg.warnings


def test_accepted_values_of_refused_fields_load(tmp_path):
    cfg = load(
        tmp_path,
        """
        pipeline: glm_image
        stages:
          - stage_id: 0
            num_replicas: 1
            sequence_parallel_size: 1
          - stage_id: 1
            tensor_parallel_size: 1
            enable_cpu_offload: false
            default_sampling_params: {output_type: pil}
        """,
    )
    assert cfg.stage(0).num_replicas == 1 and not cfg.warnings


def test_validate_cli_refuses_and_warns_naming_the_field(tmp_path, capsys):
    from vllm_omni_plugin.cli import main

    bad = write(
        tmp_path,
        """
        pipeline: glm_image
        stages:
          - stage_id: 0
            num_replicas: 2
          - stage_id: 1
            gpu_memory_utilization: 0.5
            memory_budget_gb: 4
        """,
        "bad.yaml",
    )
    assert main(["config", "validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "stage 0: num_replicas: 2 is not supported" in err
    assert "gpu_memory_utilization and memory_budget_gb" in err
    warned = write(
        tmp_path,
        """
        pipeline: glm_image
        stages:
          - stage_id: 0
            async_chunk: true
        """,
        "warned.yaml",
    )
    assert main(["config", "validate", str(warned)]) == 0
    err = capsys.readouterr().err
    assert "warning: stage 0: async_chunk has no effect" in err
