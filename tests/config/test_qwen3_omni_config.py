"""Qwen3-Omni's deploy file: the topology's stages, and no setting accepted and ignored
on the stages that run our own engines (the talker, Code2Wav) or vLLM's own chat handlers (the
thinker's defaults)."""

from __future__ import annotations

import json

from config_helpers import REPO, problems

from vllm_omni_plugin.config import load_deploy_config

TINY = REPO / "stage_configs" / "qwen3_omni_tiny.yaml"


def test_tiny_file_streams_three_stages_and_takes_the_issue_override():
    cfg = load_deploy_config(
        TINY,
        stage_overrides=json.dumps(
            {"1": {"default_sampling_params": {"temperature": 0, "max_tokens": 16}}}
        ),
    )
    topo = cfg.topology
    assert [s.name for s in topo.stages] == ["thinker", "talker", "code2wav"]
    assert topo.chat_stage == 0 and topo.audio_output
    assert topo.streams(0, 1) and topo.streams(1, 2) and topo.stage(2).stream_output
    assert cfg.stage(1).sampling.max_tokens == 16
    assert cfg.stage(1).provenance["default_sampling_params.max_tokens"] == "stage-overrides"
    assert cfg.stage(0).sampling.max_tokens == 32


def test_keys_the_speech_stages_do_not_read_are_refused_by_name():
    """The talker's vLLM engine reads vLLM's engine keys that apply to it (block_size, sampling)
    and refuses the rest (prefix caching: its prompt is embeddings; penalties it has no use for);
    Code2Wav reads only its own."""
    lines = problems(
        TINY,
        stage_overrides=json.dumps(
            {
                "1": {
                    "block_size": 16,
                    "enable_prefix_caching": True,
                    "default_sampling_params": {
                        "temperature": 0.7,
                        "top_p": 0.5,
                        "presence_penalty": 0.5,
                    },
                },
                "2": {"memory_budget_gb": 4, "enforce_eager": True},
            }
        ),
    )
    text = "\n".join(lines)
    for field in (
        "stage 1: enable_prefix_caching",
        "stage 1: default_sampling_params.presence_penalty",
        "stage 2: memory_budget_gb",
    ):
        assert field in text and "does not read it" in text, (field, text)
    for read in ("block_size", "default_sampling_params.temperature", "top_p", "enforce_eager"):
        assert f"stage 1: {read}" not in text, (read, text)
    assert "stage 2: enforce_eager" not in text  # Code2Wav's CUDA graphs


def test_talker_max_model_len_bounds_speech_prompts_and_must_leave_room():
    from vllm_omni_plugin.pipelines.qwen3_omni import speech_prompt_limit

    cfg = load_deploy_config(TINY)
    assert speech_prompt_limit(cfg.stages) == 1024 - 64 - 9  # the tiny file's talker
    lines = problems(TINY, stage_overrides='{"1": {"max_model_len": 70}}')
    assert len(lines) == 1 and "max_model_len leaves -3 prompt ids" in lines[0], lines


def test_talker_and_code2wav_enforce_eager_is_read_and_shown():
    cfg = load_deploy_config(
        TINY, stage_overrides='{"1": {"enforce_eager": true}, "2": {"enforce_eager": true}}'
    )
    assert cfg.stage(1).talker.enforce_eager is True
    assert cfg.stage(2).code2wav.enforce_eager is True
    for sid in (1, 2):
        assert cfg.stage(sid).runtime.enforce_eager is None  # each kind's own settings hold it
        assert cfg.stage(sid).provenance["enforce_eager"] == "stage-overrides"
    # read, so not warned about as having no effect (as on other diffusion stages)
    assert not any("enforce_eager" in w for w in cfg.warnings), cfg.warnings


def test_thinker_defaults_vllm_handlers_do_not_take_are_refused():
    lines = problems(
        TINY, stage_overrides='{"0": {"default_sampling_params": {"stop": ["x"], "top_k": 5}}}'
    )
    assert len(lines) == 1 and "stage 0: default_sampling_params.stop" in lines[0], lines


def test_chat_defaults_become_vllm_generation_config_overrides():
    from vllm_omni_plugin.config.owners_ar import generation_config_overrides

    cfg = load_deploy_config(
        TINY, stage_overrides='{"0": {"default_sampling_params": {"temperature": 0.3}}}'
    )
    assert generation_config_overrides(cfg.stage(0).sampling) == {
        "temperature": 0.3,
        "max_new_tokens": 32,
    }
