"""Rule 1 (schema, owners, unknown keys), rule 6 (interpolation) and bad inputs people write."""

from __future__ import annotations

import pytest
from config_helpers import GLM_MIN, load, problems, write

from vllm_omni_plugin.config import ASYNC_SCHEDULER, load_deploy_config


def test_bundled_glm_image_resolves_published_defaults():
    cfg = load_deploy_config("glm_image")
    ar, dit = cfg.stage(0), cfg.stage(1)
    assert (cfg.pipeline, ar.kind, dit.kind) == ("glm_image", "ar", "diffusion")
    assert ar.devices == "0" and dit.devices == "1"
    s = ar.sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.stop_token_ids) == (0.9, 0.75, 4353, [16385])
    d = dit.sampling
    assert (d.num_inference_steps, d.guidance_scale, d.height, d.width) == (50, 1.5, 1024, 1024)
    assert ar.scheduler.scheduler_cls == ASYNC_SCHEDULER and ar.scheduler.async_scheduling is True
    # the GPU configs' DiT compiles, on two GPUs as on one (glm_image_1gpu inherits it)
    for name in ("glm_image", "glm_image_1gpu"):
        diffusion = load_deploy_config(name).stage(1).diffusion
        assert diffusion.compile_transformer and diffusion.compile_regional, name


def test_flat_and_nested_engine_args_both_survive(tmp_path):
    cfg = load(
        tmp_path,
        """
        pipeline: glm_image
        stages:
          - stage_id: 0
            max_num_seqs: 3
            engine_args:
              gpu_memory_utilization: 0.5
              hf_overrides: {a: 1}
            hf_overrides: {b: 2}
            runtime:
              devices: "2"
              env: {FOO: bar}
    """,
    )
    ar = cfg.stage(0)
    assert ar.scheduler.max_num_seqs == 3
    assert ar.cache.gpu_memory_utilization == 0.5
    assert ar.model.hf_overrides == {"a": 1, "b": 2}
    assert ar.devices == "2" and ar.env == {"FOO": "bar"}
    kw = ar.engine_kwargs()
    assert kw["max_num_seqs"] == 3 and kw["gpu_memory_utilization"] == 0.5
    assert "devices" not in kw and "env" not in kw


def test_unknown_key_is_an_error_with_suggestion(tmp_path):
    lines = problems(write(tmp_path, GLM_MIN + "    max_num_seq: 4\n"))
    assert lines == [
        f"error: {tmp_path / 'cfg.yaml'}: stage 1: max_num_seq: unknown key for a "
        "diffusion stage (did you mean 'max_num_seqs'?)"
    ] or any("max_num_seq" in line and "did you mean" in line for line in lines)
    lines = problems(write(tmp_path, "pipline: glm_image\nstages: [{stage_id: 0}]\n"))
    assert any("pipline" in line and "did you mean 'pipeline'" in line for line in lines)
    lines = problems(
        write(tmp_path, GLM_MIN + "    default_sampling_params: {num_inference_step: 3}\n")
    )
    assert any("num_inference_step" in line and "num_inference_steps" in line for line in lines)


def test_unset_and_set_to_default_are_distinguishable(tmp_path):
    cfg = load(
        tmp_path,
        """
        pipeline: glm_image
        stages:
          - stage_id: 0
            tensor_parallel_size: 1
    """,
    )
    ar = cfg.stage(0)
    assert ar.parallel.tensor_parallel_size == ar.parallel.pipeline_parallel_size == 1
    assert "tensor_parallel_size" in ar.parallel.model_fields_set
    assert "pipeline_parallel_size" not in ar.parallel.model_fields_set
    assert ar.provenance["tensor_parallel_size"] == "yaml"
    assert ar.provenance["pipeline_parallel_size"] == "default"
    assert (
        "tensor_parallel_size" in ar.engine_kwargs()
        and "pipeline_parallel_size" not in ar.engine_kwargs()
    )


def test_interpolation_env_decode_and_typing(tmp_path, monkeypatch):
    text = """
        pipeline: glm_image
        stages:
          - stage_id: 0
            devices: "0,1"
            tensor_parallel_size: ${oc.decode:${oc.env:AR_TP,1}}
            max_num_seqs: ${oc.env:SEQS,"4"}
          - stage_id: 1
            default_sampling_params:
              num_inference_steps: ${oc.env:STEPS,"7"}
    """
    monkeypatch.delenv("AR_TP", raising=False)
    cfg = load(tmp_path, text)
    assert cfg.stage(0).parallel.tensor_parallel_size == 1  # the decode-of-int-default trap
    assert cfg.stage(0).scheduler.max_num_seqs == 4  # the string "4" typed as an int
    assert cfg.stage(1).sampling.num_inference_steps == 7
    monkeypatch.setenv("AR_TP", "2")
    cfg = load(tmp_path, text)
    assert cfg.stage(0).parallel.tensor_parallel_size == 2
    assert cfg.stage(0).provenance["tensor_parallel_size"] == "yaml+env:AR_TP"


def test_missing_env_var_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VAR_X", raising=False)
    lines = problems(
        write(tmp_path, GLM_MIN.replace('devices: "1"', "devices: ${oc.env:NO_SUCH_VAR_X}"))
    )
    assert len(lines) == 1
    assert "stage 1: devices:" in lines[0] and "NO_SUCH_VAR_X" in lines[0]


@pytest.mark.parametrize(
    ("stage_text", "field", "needle"),
    [
        (
            "  - stage_id: 0\n    gpu_memory_utilization: 1.5\n",
            "gpu_memory_utilization",
            "less than or equal to 1",
        ),
        (
            "  - stage_id: 0\n    tensor_parallel_size: 0\n",
            "tensor_parallel_size",
            "greater than or equal to 1",
        ),
        ("  - stage_id: 0\n    max_num_seqs: many\n", "max_num_seqs", "valid integer"),
        (
            "  - stage_id: 1\n    default_sampling_params: {num_inference_steps: 0}\n",
            "num_inference_steps",
            "greater than or equal to 1",
        ),
        (
            "  - stage_id: 1\n    default_sampling_params: {num_inference_steps: -3}\n",
            "num_inference_steps",
            "greater than or equal to 1",
        ),
        (
            "  - stage_id: 1\n    default_sampling_params: {guidance_scale: -1.0}\n",
            "guidance_scale",
            "greater than or equal to 0",
        ),
        (
            "  - stage_id: 1\n    default_sampling_params: {height: 1000}\n",
            "height",
            "multiple of 32",
        ),
        (
            "  - stage_id: 1\n    default_sampling_params: {num_inference_steps: 500}\n",
            "num_inference_steps",
            "exceeds max_num_inference_steps",
        ),
        ("  - stage_id: 0\n    devices: gpu0\n", "devices", "device list"),
        (
            '  - stage_id: 0\n    devices: "0"\n    tensor_parallel_size: 2\n',
            "tensor_parallel_size",
            "needs 2 devices",
        ),
        ("  - stage_id: 0\n    default_sampling_params: {top_p: 0}\n", "top_p", "greater than 0"),
        ("  - stage_id: 0\n    enforce_eager: maybe\n", "enforce_eager", "valid boolean"),
        ("  - stage_id: 0\n    num_replicas: 0\n", "num_replicas", "greater than or equal to 1"),
        (
            "  - stage_id: 0\n    kv_cache_dtype_skip_layers: 3\n",
            "kv_cache_dtype_skip_layers",
            "expected list",
        ),
    ],
)
def test_out_of_range_and_wrong_types(tmp_path, stage_text, field, needle):
    lines = problems(write(tmp_path, "pipeline: glm_image\nstages:\n" + stage_text))
    assert any(field in line and needle in line for line in lines), lines
    assert all(line.startswith("error: ") and ": stage " in line for line in lines)


def test_structural_bad_inputs(tmp_path):
    assert "top level must be a mapping" in problems(write(tmp_path, "- stage_id: 0\n"))[0]
    assert "no stages" in problems(write(tmp_path, "pipeline: glm_image\nstages: []\n"))[0]
    dup = problems(
        write(tmp_path, "pipeline: glm_image\nstages:\n  - stage_id: 0\n  - stage_id: 0\n")
    )
    assert any("duplicate stage_id 0" in line for line in dup)
    missing = problems(write(tmp_path, "pipeline: glm_image\nstages:\n  - stage_id: 5\n"))
    assert any("stage 5" in line and "no stage 5" in line for line in missing)
    assert "file is empty" in problems(write(tmp_path, ""))[0]


def test_yaml_syntax_error_has_line_number(tmp_path):
    path = write(
        tmp_path,
        "pipeline: glm_image\nstages:\n  - stage_id: 0\n    devices: [0, 1\n  - stage_id: 1\n",
    )
    (line,) = problems(path)
    assert line.startswith(f"error: {path}: line ") and "YAML syntax error" in line


def test_diffusion_stage_uses_vllm_omni_max_num_seqs_as_batch_size(tmp_path):
    cfg = load(tmp_path, GLM_MIN + "    max_num_seqs: 3\n    enable_prefix_caching: false\n")
    assert cfg.stage(1).diffusion.max_batch_size == 3
    assert any("enable_prefix_caching" in w for w in cfg.warnings)


def test_serving_limits_are_typed(tmp_path):
    cfg = load(tmp_path, GLM_MIN + "serving: {max_n: 2, max_prompt_chars: 100}\n")
    assert cfg.serving.max_n == 2 and cfg.stage(1).serving.max_prompt_chars == 100
    lines = problems(write(tmp_path, GLM_MIN + "serving: {max_n: 0, max_promt_chars: 5}\n"))
    assert any("serving.max_n" in line for line in lines)
    assert any("max_promt_chars" in line and "max_prompt_chars" in line for line in lines)
