"""Rules 7-9: model paths, precedence and merging, stage overrides, env, provenance."""

from __future__ import annotations

from config_helpers import GLM_MIN, load, problems, write

from vllm_omni_plugin.common.messages import decode_to_stage, encode
from vllm_omni_plugin.config import load_deploy_config
from vllm_omni_plugin.config.stage_init import StageInit

BASE = """
pipeline: glm_image
model: /models/base
trust_remote_code: true
stages:
  - stage_id: 0
    max_num_seqs: 2
    gpu_memory_utilization: 0.5
    env: {A: "1"}
    omni_kv_config: {need_send_cache: true, keep: 1}
    default_sampling_params: {temperature: 0.9, top_p: 0.75}
  - stage_id: 1
    default_sampling_params: {num_inference_steps: 50, guidance_scale: 1.5}
platforms:
  cuda:
    stages:
      - stage_id: 0
        max_num_seqs: 6
        trust_remote_code: false
"""


def test_model_paths_and_override_on_stage_one_only(tmp_path):
    cfg = load(tmp_path, GLM_MIN, model="/m/GLM-Image")
    ar, dit = cfg.stage(0), cfg.stage(1)
    assert ar.model_path == "/m/GLM-Image/vision_language_encoder"
    assert ar.tokenizer_path == "/m/GLM-Image/processor"
    assert dit.model_path == "/m/GLM-Image" and dit.pipeline_model_path == "/m/GLM-Image"
    kw = ar.engine_kwargs()
    assert kw["model"] == ar.model_path and kw["tokenizer"] == ar.tokenizer_path
    cfg = load(
        tmp_path, GLM_MIN, model="/m/GLM-Image", stage_overrides={"1": {"model": "/other/dit"}}
    )
    assert cfg.stage(1).model_path == "/other/dit"
    assert cfg.stage(0).model_path == "/m/GLM-Image/vision_language_encoder"
    # the CLI model beats the YAML's
    assert load(tmp_path, BASE, model="/cli").model == "/cli"
    assert load(tmp_path, BASE).stage(1).model_path == "/models/base"


def test_bundled_name_resolves():
    assert load_deploy_config("glm_image").file.endswith("stage_configs/glm_image.yaml")


def test_precedence_layers(tmp_path):
    cfg = load(
        tmp_path,
        BASE,
        platform="cuda",
        stage_overrides='{"0": {"max_num_seqs": 9}}',
        cli_overrides={"max_num_seqs": 7},
    )
    ar = cfg.stage(0)
    assert ar.scheduler.max_num_seqs == 9 and ar.provenance["max_num_seqs"] == "stage-overrides"
    # the pipeline-wide field beats the platform section
    assert ar.model.trust_remote_code is True and ar.provenance["trust_remote_code"] == "pipeline"
    cfg = load(tmp_path, BASE, platform="cuda", cli_overrides={"max_num_seqs": 7})
    assert (
        cfg.stage(0).scheduler.max_num_seqs == 7
        and cfg.stage(0).provenance["max_num_seqs"] == "cli"
    )
    cfg = load(tmp_path, BASE, platform="cuda")
    assert (
        cfg.stage(0).scheduler.max_num_seqs == 6
        and cfg.stage(0).provenance["max_num_seqs"] == "platform:cuda"
    )
    cfg = load(tmp_path, BASE, platform="cpu")
    assert (
        cfg.stage(0).scheduler.max_num_seqs == 2
        and cfg.stage(0).provenance["max_num_seqs"] == "yaml"
    )
    assert cfg.stage(0).provenance["block_size"] == "default"


def test_overrides_deep_merge_except_omni_kv_config(tmp_path):
    cfg = load(
        tmp_path,
        BASE,
        stage_overrides={
            "0": {
                "default_sampling_params": {"temperature": 0.1},
                "omni_kv_config": {"need_send_cache": False},
            },
            "1": {"default_sampling_params": {"num_inference_steps": 8}},
        },
    )
    ar, dit = cfg.stage(0), cfg.stage(1)
    assert (ar.sampling.temperature, ar.sampling.top_p) == (0.1, 0.75)
    assert ar.connector.omni_kv_config == {"need_send_cache": False}  # replaced whole
    assert (dit.sampling.num_inference_steps, dit.sampling.guidance_scale) == (8, 1.5)
    assert dit.provenance["default_sampling_params.num_inference_steps"] == "stage-overrides"
    assert dit.provenance["default_sampling_params.guidance_scale"] == "yaml"


def test_bad_overrides(tmp_path):
    path = write(tmp_path, BASE)
    assert any(
        "no stage 7" in line
        for line in problems(path, stage_overrides='{"7": {"max_num_seqs": 1}}')
    )
    assert any("not valid JSON" in line for line in problems(path, stage_overrides="{1:"))
    assert any(
        "max_num_seqs" in line
        for line in problems(path, stage_overrides={"0": {"max_num_seqs": 0}})
    )


def test_env_survives_to_the_stage_process(tmp_path):
    cfg = load(tmp_path, BASE, stage_overrides={"0": {"env": {"B": 2}}})
    spec = cfg.topology.stages[0]
    sent = StageInit(cfg.stage(0), spec, cfg.pipeline).to_message()
    stage = StageInit.from_message(decode_to_stage(encode(sent))).stage  # as the stage reads it
    assert stage.env == {"A": "1", "B": "2"}
    assert stage.provenance["env.A"] == "yaml" and stage.provenance["env.B"] == "stage-overrides"


def test_base_config_inherits_by_stage_id(tmp_path):
    write(tmp_path, BASE, "base.yaml")
    cfg = load(
        tmp_path,
        """
        base_config: base.yaml
        stages:
          - stage_id: 0
            default_sampling_params: {temperature: 0.5}
    """,
        platform="cpu",
    )
    ar = cfg.stage(0)
    assert (ar.sampling.temperature, ar.sampling.top_p, ar.scheduler.max_num_seqs) == (0.5, 0.75, 2)
    assert ar.provenance["max_num_seqs"] == "yaml:base.yaml"
    assert ar.provenance["default_sampling_params.temperature"] == "yaml"


def test_edges_and_connectors(tmp_path):
    cfg = load_deploy_config("glm_image_nixl")
    assert cfg.edges[0].connector == "nixl" and cfg.connectors["nixl"].type == "nixl"
    lines = problems(write(tmp_path, GLM_MIN + "edges: [{from: 0, to: 1, connector: nixl}]\n"))
    assert any("connector 'nixl'" in line for line in lines)
    lines = problems(write(tmp_path, GLM_MIN + "connectors: {x: {name: MooncakeStoreConnector}}\n"))
    assert any("unsupported connector" in line for line in lines)
    lines = problems(write(tmp_path, GLM_MIN + "edges: [{from: 1, to: 0}]\n"))
    assert any("not an edge" in line for line in lines)
