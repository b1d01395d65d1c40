"""Stage kinds in deploy files: each stage's `kind:` must be the topology's, and the talker and
Code2Wav kinds read only their own typed settings (config/owners_talker.py,
config/owners_code2wav.py): any other key fails at load naming it, and bad values fail naming
the field."""

from __future__ import annotations

import json

import pytest
from config_helpers import GLM_MIN, REPO, load, problems, write

from vllm_omni_plugin.config import load_deploy_config

TINY = REPO / "stage_configs" / "qwen3_omni_tiny.yaml"


def test_bundled_files_state_the_kinds_of_the_topology():
    cfg = load_deploy_config(TINY)
    assert [s.kind for s in cfg.stages] == ["ar", "talker", "code2wav"]
    assert [s.kind for s in cfg.topology.stages] == ["ar", "talker", "code2wav"]
    talker, code2wav = cfg.stage(1), cfg.stage(2)
    # each kind holds only its own settings: no vLLM owners on either, no sampling on Code2Wav
    assert talker.talker is not None and code2wav.code2wav is not None
    for stage in (talker, code2wav):
        assert (stage.model, stage.load, stage.parallel, stage.cache, stage.scheduler) == (
            None,
            None,
            None,
            None,
            None,
        )
        assert stage.diffusion is None
    assert talker.code2wav is None and code2wav.talker is None and code2wav.sampling is None
    assert code2wav.flat_dict()["default_sampling_params"] == {}


@pytest.mark.parametrize(
    ("sid", "wrong", "right"),
    [
        (0, "talker", "ar"),
        (1, "ar", "talker"),
        (2, "diffusion", "code2wav"),
        (1, "singer", "talker"),
    ],
)
def test_a_wrong_kind_fails_at_load_naming_the_field(sid, wrong, right):
    lines = problems(TINY, stage_overrides=json.dumps({str(sid): {"kind": wrong}}))
    assert lines == [
        f"error: {TINY}: stage {sid}: kind: is {wrong!r} but stage {sid} "
        f"({['thinker', 'talker', 'code2wav'][sid]}) of pipeline 'qwen3_omni' is of kind {right!r}"
    ], lines


def test_kinds_of_other_pipelines_are_checked_too(tmp_path):
    text = GLM_MIN.replace('devices: "1"', 'devices: "1"\n    kind: ar')
    lines = problems(write(tmp_path, text))
    assert len(lines) == 1 and "stage 1: kind: is 'ar'" in lines[0], lines
    ok = GLM_MIN.replace('devices: "0"', 'devices: "0"\n    kind: ar')
    assert load(tmp_path, ok.replace('devices: "1"', 'devices: "1"\n    kind: diffusion'))


def test_the_talker_engine_takes_every_talker_setting():
    """Each TalkerSettings field set in the deploy file reaches the talker's vLLM engine
    arguments (and nothing of the AR stages' owners does)."""
    from vllm_omni_plugin.config.owners_talker import TalkerSettings

    values = {
        "dtype": "float32",
        "seed": 7,
        "max_num_seqs": 3,
        "max_model_len": 512,
        "max_num_batched_tokens": 256,
        "enable_chunked_prefill": False,
        "async_scheduling": True,
        "gpu_memory_utilization": 0.4,
        "kv_cache_memory_bytes": 1 << 20,
        "block_size": 32,
        "enforce_eager": True,
        "compilation_config": {"cudagraph_mode": "NONE"},
        "max_cudagraph_capture_size": 8,
        "cudagraph_capture_sizes": [1, 2, 4, 8],
    }
    assert set(values) == set(TalkerSettings.model_fields)
    cfg = load_deploy_config(TINY, stage_overrides=json.dumps({"1": values}))
    kwargs = cfg.stage(1).engine_kwargs()
    assert kwargs == {**values, "model": None}
    assert cfg.stage(1).gpu_share == 0.4 and not cfg.stage(1).profiles_gpu_at_start


@pytest.mark.parametrize("value", [True, False, None])
def test_the_talker_engine_schedules_as_the_deploy_says(monkeypatch, value):
    """The talker's `async_scheduling` reaches its engine as set; unset, vLLM chooses (async
    where the platform supports it): the talker's own engine arguments do not override it."""
    from vllm_omni_plugin.stages.qwen3_omni import _V2_RUNNER_ENV, talker_engine_kwargs

    monkeypatch.setenv(_V2_RUNNER_ENV, "0")  # restored after: talker_engine_kwargs sets it
    overrides = {} if value is None else {"1": {"async_scheduling": value}}
    cfg = load_deploy_config(TINY, stage_overrides=json.dumps(overrides))
    kwargs = talker_engine_kwargs(cfg.stage(1), "ipc:///nowhere")
    assert kwargs.get("async_scheduling", "unset") == ("unset" if value is None else value)


def test_code2wav_takes_vllm_omnis_max_num_seqs_as_its_batch_size(tmp_path):
    text = TINY.read_text().replace("    max_batch_size: 4\n", "    max_num_seqs: 3\n")
    cfg = load_deploy_config(write(tmp_path, text, "q.yaml"))
    assert cfg.stage(2).code2wav.max_batch_size == 3
    assert cfg.stage(2).provenance["max_batch_size"] == "yaml"


@pytest.mark.parametrize(
    ("stage", "values", "field"),
    [
        (1, {"dtype": "int8"}, "dtype"),
        (1, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        (1, {"cudagraph_capture_sizes": [0, 2]}, "cudagraph_capture_sizes"),
        (1, {"default_sampling_params": {"top_p": 0}}, "default_sampling_params.top_p"),
        (
            1,
            {"default_sampling_params": {"max_tokens": 4096}},
            "default_sampling_params.max_tokens",
        ),
        (2, {"dtype": "float64"}, "dtype"),
        (2, {"max_batch_size": 0}, "max_batch_size"),
        (2, {"enforce_eager": "sometimes"}, "enforce_eager"),
    ],
)
def test_bad_values_fail_naming_the_field(stage, values, field):
    lines = problems(TINY, stage_overrides=json.dumps({str(stage): values}))
    assert len(lines) == 1 and f"stage {stage}: {field}: " in lines[0], lines


@pytest.mark.parametrize(
    ("stage", "key", "value"),
    [
        (1, "max_batch_size", 4),  # Code2Wav's, not the talker's
        (1, "kv_cache_dtype", "fp8"),
        (1, "async_chunk", True),
        (2, "max_model_len", 512),  # the talker's, not Code2Wav's
        (2, "memory_budget_gb", 2),
        (2, "default_sampling_params", {"seed": 1}),
    ],
)
def test_a_setting_of_another_kind_fails_naming_the_field(stage, key, value):
    lines = problems(TINY, stage_overrides=json.dumps({str(stage): {key: value}}))
    field = key if not isinstance(value, dict) else f"{key}.seed"
    assert len(lines) == 1 and f"stage {stage}: {field}: " in lines[0], lines
    assert "does not read it" in lines[0] and "It reads only" in lines[0], lines


def test_an_unknown_key_is_named_once_with_a_suggestion():
    lines = problems(TINY, stage_overrides='{"2": {"max_batch_sise": 2}}')
    assert lines == [
        f"error: {TINY}: stage 2: max_batch_sise: unknown key for a code2wav stage "
        "(did you mean 'max_batch_size'?)"
    ], lines


def test_a_code2wav_stage_on_the_cpu_asks_ray_for_no_gpu():
    from vllm_omni_plugin.orchestrator.ray_backend import replica_resources

    cfg = load_deploy_config(TINY)  # Code2Wav: device: cpu
    assert replica_resources(cfg.stage(2), "cuda") == {"num_cpus": 1, "num_gpus": 0}
    assert replica_resources(cfg.stage(1), "cuda") == {"num_cpus": 1, "num_gpus": 1}


def test_each_stage_reaches_its_process_with_its_kinds_classes():
    """A stage process rebuilds its StageConfig from JSON: the talker's sampling defaults
    (also valid AR defaults) come back as the talker's class, every stage equal."""
    from vllm_omni_plugin.config.deploy import StageConfig
    from vllm_omni_plugin.config.owners_talker import TalkerSamplingDefaults

    for stage in load_deploy_config(TINY).stages:
        back = StageConfig.model_validate_json(stage.model_dump_json())
        assert back == stage and type(back.sampling) is type(stage.sampling), stage.kind
    talker = load_deploy_config(TINY).stage(1)
    assert type(StageConfig.model_validate_json(talker.model_dump_json()).sampling) is (
        TalkerSamplingDefaults
    )
