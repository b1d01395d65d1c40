"""Rules 3-5: legacy `stage_args`, vLLM-Omni's own files (both schemas), scheduler pairing."""

from __future__ import annotations

from config_helpers import FIXTURES, load, problems, write

from vllm_omni_plugin.config import ASYNC_SCHEDULER, SYNC_SCHEDULER, load_deploy_config
from vllm_omni_plugin.config.migrate_cmd import migrated_yaml

LEGACY = """
stage_args:
  - stage_id: 0
    stage_type: llm
    runtime: {devices: "0", max_batch_size: 2}
    engine_args:
      model_arch: GlmImageForConditionalGeneration
      worker_cls: vllm_omni.worker.gpu_ar_worker.GPUARWorker
      scheduler_cls: vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler
      gpu_memory_utilization: 0.6
    engine_input_source: []
    final_output: false
    default_sampling_params: {temperature: 0.9}
  - stage_id: 1
    stage_type: diffusion
    runtime: {devices: "1"}
    engine_args: {model_arch: GlmImagePipeline}
    engine_input_source: [0]
    custom_process_input_func: vllm_omni.model_executor.stage_input_processors.glm_image.ar2diffusion
    final_output: true
    final_output_type: image
runtime:
  enabled: true
  defaults: {window_size: -1, max_inflight: 1}
  edges: [{from: 0, to: 1, window_size: -1}]
"""


def test_vllm_omni_016_legacy_glm_image_loads_with_deprecation():
    cfg = load_deploy_config(FIXTURES / "vo16_glm_image.yaml")
    assert cfg.pipeline == "glm_image"
    assert any("stage_args" in w and "config migrate" in w for w in cfg.warnings)
    assert any("worker_cls" in w and "custom_process_input_func" not in w for w in cfg.warnings)
    ar, dit = cfg.stage(0), cfg.stage(1)
    assert (
        ar.devices == "0"
        and ar.scheduler.max_num_seqs == 1
        and ar.cache.gpu_memory_utilization == 0.6
    )
    # the legacy file pins the sync scheduler and leaves async unset: a matched pair
    assert (ar.scheduler.scheduler_cls, ar.scheduler.async_scheduling) == (SYNC_SCHEDULER, False)
    assert dit.sampling.num_inference_steps == 50 and dit.sampling.guidance_scale == 1.5
    # the same schema defaults as a new file
    assert dit.diffusion.max_num_inference_steps == 100 and ar.parallel.tensor_parallel_size == 1


def test_vllm_omni_030_stages_files_load():
    cfg = load_deploy_config(FIXTURES / "vo30_glm_image.yaml", platform="cuda")
    ar = cfg.stage(0)
    assert (ar.scheduler.scheduler_cls, ar.scheduler.async_scheduling) == (ASYNC_SCHEDULER, True)
    assert ar.sampling.max_tokens == 4353 and cfg.stage(1).diffusion.max_batch_size == 1
    # the npu section applies only on npu; there it changes devices and TP, and asks for
    # sequence_parallel_size, which does not exist here: refused, naming the field (its
    # ulysses_degree 4 is the diffusion stage's Ulysses knob: accepted)
    lines = problems(
        FIXTURES / "vo30_glm_image.yaml",
        platform="npu",
        stage_overrides={"0": {"scheduler_cls": None}},
    )
    assert any("stage 1: sequence_parallel_size: 4 is not supported" in x for x in lines), lines
    assert not any("ulysses_degree" in x for x in lines), lines
    npu = load_deploy_config(
        FIXTURES / "vo30_glm_image.yaml",
        platform="npu",
        stage_overrides={
            "0": {"scheduler_cls": None},
            "1": {"sequence_parallel_size": 1},
        },
    )
    assert npu.stage(1).diffusion.ulysses_degree == 4
    assert npu.stage(0).parallel.tensor_parallel_size == 4 and npu.stage(0).devices == "0,1,2,3"
    assert npu.stage(0).env["HCCL_IF_BASE_PORT"] == "23000"
    assert npu.stage(0).provenance["devices"] == "platform:npu"
    multi = load_deploy_config(FIXTURES / "vo16_glm_image_muilticonnector.yaml")
    assert multi.edges[0].connector == "shm"


def test_unsupported_vllm_omni_pipelines_fail_clearly():
    # (vLLM-Omni's qwen3_omni_moe.yaml: test_qwen3_omni_deploy.py)
    lines = [line for line in problems(FIXTURES / "vo16_qwen2_5_omni.yaml")]
    assert len(lines) == 1 and "unsupported pipeline" in lines[0], lines


def test_legacy_gets_validation(tmp_path):
    bad = LEGACY.replace("gpu_memory_utilization: 0.6", "gpu_memory_utilization: 2")
    assert any("gpu_memory_utilization" in line for line in problems(write(tmp_path, bad)))
    dangling = LEGACY.replace("engine_input_source: [0]", "engine_input_source: [4]")
    assert any(
        "stage 4, which does not exist" in line for line in problems(write(tmp_path, dangling))
    )
    cycle = LEGACY.replace("engine_input_source: []", "engine_input_source: [1]")
    assert any("cycle" in line for line in problems(write(tmp_path, cycle)))
    wrong_kind = LEGACY.replace("stage_type: diffusion", "stage_type: llm")
    assert any("stage_type" in line for line in problems(write(tmp_path, wrong_kind)))


def test_migrate_round_trips(tmp_path):
    text = migrated_yaml(str(write(tmp_path, LEGACY, "legacy.yaml")))
    assert "stage_args:" not in text and "pipeline: glm_image" in text and "worker_cls:" not in text
    assert SYNC_SCHEDULER in text
    migrated = load(tmp_path, text)
    original = load_deploy_config(tmp_path / "legacy.yaml")
    assert migrated.to_dict() == original.to_dict()
    assert not any("stage_args" in w for w in migrated.warnings)


def test_scheduler_pairing(tmp_path):
    def pair(extra: str):
        cfg = load(tmp_path, f"pipeline: glm_image\nstages:\n  - stage_id: 0\n{extra}")
        return cfg.stage(0).scheduler.scheduler_cls, cfg.stage(0).scheduler.async_scheduling

    assert pair("    async_scheduling: false\n") == (SYNC_SCHEDULER, False)
    assert pair("    devices: '0'\n") == (ASYNC_SCHEDULER, True)
    assert pair(f"    scheduler_cls: {ASYNC_SCHEDULER}\n") == (ASYNC_SCHEDULER, True)
    assert pair("    scheduler_cls: OmniARScheduler\n    async_scheduling: false\n") == (
        SYNC_SCHEDULER,
        False,
    )
    mismatch = write(
        tmp_path,
        "pipeline: glm_image\nstages:\n  - stage_id: 0\n"
        "    scheduler_cls: vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler\n"
        "    async_scheduling: true\n",
    )
    (line,) = problems(mismatch)
    assert "stage 0: scheduler_cls" in line and ASYNC_SCHEDULER in line
    unknown = write(
        tmp_path, "pipeline: glm_image\nstages:\n  - stage_id: 0\n    scheduler_cls: my.Sched\n"
    )
    assert "unknown AR scheduler" in problems(unknown)[0]
