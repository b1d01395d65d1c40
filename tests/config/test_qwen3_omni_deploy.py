"""Qwen3-Omni deploy files: ours (stage_configs/qwen3_omni*.yaml) validate against the tiny and
the full-size checkpoint's config.json; vLLM-Omni 0.26's and 0.30's own `qwen3_omni_moe.yaml`
map to `pipeline: qwen3_omni`, their thinker settings taken whole, and every key the talker or
Code2Wav engine has no use for refused by name (nothing accepted and then ignored)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from config_helpers import FIXTURES, REPO, problems, write

from vllm_omni_plugin.cli import main
from vllm_omni_plugin.config import ConfigError, load_deploy_config
from vllm_omni_plugin.config.connectors_cfg import CODE2WAV_CHUNKING
from vllm_omni_plugin.config.migrate_cmd import migrated_yaml

INCUMBENT = ("vo26_qwen3_omni_moe.yaml", "vo30_qwen3_omni_moe.yaml")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """config.json of the tiny and of the full-size checkpoint (all validation reads)."""
    from vllm_omni_plugin.testing import full_qwen3_omni as full
    from vllm_omni_plugin.testing import tiny_qwen3_omni as tiny

    class _RoleVocab:  # the full tokenizer's role ids, without building its 152k vocabulary
        def get_vocab(self):
            return full.ROLE_IDS

    out = {}
    for size, cfg in (
        ("tiny", tiny.build_config()),
        ("full", full.build_config(tiny.token_ids(_RoleVocab(), full.SPECIALS))),
    ):
        folder = tmp_path_factory.mktemp(f"qwen3-omni-{size}")
        cfg.to_json_file(folder / "config.json")
        out[size] = folder
    assert json.loads((out["full"] / "config.json").read_text())["model_type"] == "qwen3_omni_moe"
    return out


@pytest.mark.parametrize(
    "name",
    [
        "qwen3_omni",
        "qwen3_omni_1gpu",
        "qwen3_omni_tiny",
        "qwen3_omni_nodes",
        "qwen3_omni_nodes_tiny",
        "qwen3_omni_ray",
        "qwen3_omni_ray_tiny",
    ],
)
def test_bundled_files_validate_against_tiny_and_full_checkpoints(name, model_dirs, capsys):
    for size, folder in model_dirs.items():
        path = str(REPO / "stage_configs" / f"{name}.yaml")
        assert main(["config", "validate", path, "--model", str(folder)]) == 0, (
            size,
            capsys.readouterr().err,
        )
        cfg = load_deploy_config(path, model=str(folder), platform="cuda")
        assert cfg.pipeline == "qwen3_omni" and not cfg.warnings, cfg.warnings
        assert {s.model_path for s in cfg.stages} == {str(folder)}


def test_two_node_layout_and_a_stream_into_the_head_refused():
    """qwen3_omni_nodes: the thinker on the head's first GPU, the talker and Code2Wav on the
    node's; the head runs stage 0 only. A head that would run Code2Wav while the talker is on a
    node is refused: the talker could not reach it (the head's stages take streamed edges from
    their own host only)."""
    from vllm_omni_plugin.orchestrator.remote import refuse_streams_into_head

    nodes = load_deploy_config("qwen3_omni_nodes", platform="cuda")
    assert [s.devices for s in nodes.stages] == ["0", "0", "0"]
    assert nodes.stage(1).sampling.max_tokens == 4096  # the rest is qwen3_omni.yaml's
    refuse_streams_into_head(nodes, [0])
    refuse_streams_into_head(nodes, [0, 1, 2])
    with pytest.raises(SystemExit, match="stage 1 \\(on a node\\) streams into stage 2"):
        refuse_streams_into_head(nodes, [0, 2])
    tiny = load_deploy_config("qwen3_omni_nodes_tiny")
    assert tiny.to_dict()["stages"] == load_deploy_config("qwen3_omni_tiny").to_dict()["stages"]


def test_ray_layout_two_replicas_of_every_stage():
    """qwen3_omni_ray: every stage 2 replicas on Ray, each replica one GPU of its own (the
    talker, no longer sharing one with Code2Wav, takes 90% of it); the tiny file is
    qwen3_omni_tiny's stages, replicated."""
    from vllm_omni_plugin.orchestrator.ray_backend import replica_resources, uses_ray

    gpu = load_deploy_config("qwen3_omni_ray", platform="cuda")
    assert uses_ray(gpu) and gpu.runtime.address == "auto"
    assert [s.num_replicas for s in gpu.stages] == [2, 2, 2]
    assert [replica_resources(s, "cuda") for s in gpu.stages] == [
        {"num_cpus": 1, "num_gpus": 1}
    ] * 3
    assert gpu.stage(1).talker.gpu_memory_utilization == 0.9
    assert gpu.stage(1).sampling.max_tokens == 4096  # the rest is qwen3_omni.yaml's
    assert gpu.stage(2).code2wav.device == "cuda"
    tiny = load_deploy_config("qwen3_omni_ray_tiny")
    assert uses_ray(tiny) and [s.num_replicas for s in tiny.stages] == [2, 2, 2]
    assert [replica_resources(s, "cpu") for s in tiny.stages] == [
        {"num_cpus": 1, "num_gpus": 0}
    ] * 3
    plain = load_deploy_config("qwen3_omni_tiny").to_dict()["stages"]
    for stage in plain:
        stage["num_replicas"] = 2
    assert tiny.to_dict()["stages"] == plain


def test_two_gpu_and_one_gpu_layouts():
    two = load_deploy_config("qwen3_omni", platform="cuda")
    thinker, talker, code2wav = two.stage(0), two.stage(1), two.stage(2)
    assert (thinker.devices, talker.devices, code2wav.devices) == ("0", "1", "1")
    # the thinker keeps vLLM's GPU defaults: CUDA graphs, async scheduling
    assert thinker.runtime.enforce_eager is None and thinker.scheduler.async_scheduling is True
    assert (thinker.kind, talker.kind, code2wav.kind) == ("ar", "talker", "code2wav")
    assert thinker.model.dtype == talker.talker.dtype == code2wav.code2wav.dtype == "bfloat16"
    assert thinker.scheduler.max_num_seqs == talker.talker.max_num_seqs == 64
    assert code2wav.code2wav.max_batch_size == 64 and code2wav.code2wav.device == "cuda"
    # the talker samples as the checkpoint does (no temperature set), on half of GPU 1
    assert (talker.sampling.temperature, talker.sampling.max_tokens) == (None, 4096)
    assert talker.talker.gpu_memory_utilization == talker.gpu_share == 0.5
    assert thinker.cache.gpu_memory_utilization == 0.9
    assert two.serving.max_input_audio_s == 300
    one = load_deploy_config("qwen3_omni_1gpu", platform="cuda")
    assert {s.devices for s in one.stages} == {"0"}
    # the thinker's share leaves a quarter of the GPU (35 GB of an H200): 12% to the talker's
    # vLLM engine, the rest to Code2Wav's ~0.5 GB of weights and its activations
    assert one.stage(0).cache.gpu_memory_utilization == 0.75
    assert one.stage(1).talker.gpu_memory_utilization == 0.12
    assert one.stage(2).gpu_share is None
    # the rest is qwen3_omni.yaml's
    assert one.stage(1).sampling.max_tokens == 4096 and one.stage(2).code2wav.max_batch_size == 64


# The keys of vLLM-Omni's talker / Code2Wav stages our stages do not read: refused by name.
# The talker runs vLLM's engine and reads its engine and sampling keys, but not prefix caching
# (its prompt is embeddings) nor remote code.
TALKER_REFUSED = {"trust_remote_code", "enable_prefix_caching"}
CODE2WAV_REFUSED = {
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "trust_remote_code",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "async_scheduling",
    *(
        f"default_sampling_params.{k}"
        for k in ("temperature", "top_p", "top_k", "max_tokens", "repetition_penalty")
    ),
}


def _refused(lines: list[str]) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for line in lines:
        where = line.split(": stage ", 1)[1]
        sid, field = where.split(": ")[:2]
        out.setdefault(int(sid), set()).add(field)
    return out


@pytest.mark.parametrize("name", INCUMBENT)
def test_incumbent_file_is_refused_field_by_field(name):
    lines = problems(FIXTURES / name, platform="cuda")
    extra = {"moe_backend"} if name.startswith("vo30") else set()
    # every refusal names a talker or Code2Wav key; the thinker's settings are all vLLM's
    assert _refused(lines) == {1: TALKER_REFUSED | extra, 2: CODE2WAV_REFUSED}, lines
    text = "\n".join(lines)
    assert "stage 2: enforce_eager" not in text  # Code2Wav's CUDA graphs follow it
    assert "enable_prefix_caching: stage 1 (talker) does not read it: its prompt is embeddings" in (
        text
    )
    assert "gpu_memory_utilization: stage 2 (code2wav) does not read it: it reserves no share" in (
        text
    )


def _without_refused(name: str, tmp_path: Path) -> Path:
    """The incumbent file with exactly the refused keys removed, as a user would edit it."""
    data = yaml.safe_load((FIXTURES / name).read_text())
    edited = copy.deepcopy(data)
    for stage in edited["stages"]:
        if stage["stage_id"] == 0:
            continue  # the thinker's keys are all vLLM's
        refused = {1: TALKER_REFUSED, 2: CODE2WAV_REFUSED}[stage["stage_id"]]
        for field in refused | {"moe_backend"}:
            head, _, rest = field.partition(".")
            holder = stage.get(head) if rest else stage
            if isinstance(holder, dict):
                holder.pop(rest or head, None)
    return write(tmp_path, yaml.safe_dump(edited), name)


@pytest.mark.parametrize("name", INCUMBENT)
def test_incumbent_file_loads_once_the_refused_keys_are_removed(name, tmp_path):
    path = _without_refused(name, tmp_path)
    cfg = load_deploy_config(path, platform="cuda")
    assert cfg.pipeline == "qwen3_omni" and cfg.provenance["pipeline"] == "derived:detected"
    thinker, talker, code2wav = cfg.stage(0), cfg.stage(1), cfg.stage(2)
    assert (thinker.devices, talker.devices, code2wav.devices) == ("0", "1", "1")
    assert (thinker.scheduler.max_num_seqs, thinker.scheduler.max_num_batched_tokens) == (64, 32768)
    assert thinker.cache.gpu_memory_utilization == 0.9
    assert thinker.cache.enable_prefix_caching is False and thinker.model.trust_remote_code
    assert (thinker.sampling.temperature, thinker.sampling.max_tokens) == (0.0, 2048)
    assert (talker.talker.max_num_seqs, talker.sampling.max_tokens) == (64, 4096)
    assert code2wav.code2wav.max_batch_size == 64  # vLLM-Omni's max_num_seqs of the stage
    assert code2wav.code2wav.enforce_eager is False  # its CUDA graphs, as there
    # input_connectors name vLLM-Omni's SharedMemoryConnector: shared memory on both edges
    assert [(e.from_stage, e.to_stage, e.connector) for e in cfg.edges] == [
        (0, 1, "connector_of_shared_memory"),
        (1, 2, "connector_of_shared_memory"),
    ]
    # its Code2Wav chunking (4, then 25 with 25 of context) is what runs here: no option left
    assert cfg.connectors["connector_of_shared_memory"].options == {}
    # async_chunk: true is what this pipeline does (stages stream): nothing to warn about
    assert not any("async_chunk" in w for w in cfg.warnings), cfg.warnings
    if name.startswith("vo30"):  # its cuda section: vLLM's rotary op for the thinker's MRoPE
        assert thinker.runtime.compilation_config == {"custom_ops": ["+rotary_embedding"]}
        assert thinker.engine_extras["moe_backend"] == "triton"


@pytest.mark.parametrize("name", INCUMBENT)
def test_incumbent_platform_sections_refuse_talker_keys(name, tmp_path):
    path = _without_refused(name, tmp_path)
    lines = problems(path, platform="npu")
    # The talker's vLLM engine reads its share, token budget and compilation settings.
    assert _refused(lines) == {
        2: {"gpu_memory_utilization", "compilation_config.cudagraph_mode"},
    }, lines
    assert any(
        "cudagraph_mode: stage 2 (code2wav) does not read it: it is not compiled" in x
        for x in lines
    )
    lines = problems(path, platform="xpu")
    # Its talker's and Code2Wav's enforce_eager: true is read (they run without CUDA graphs).
    assert _refused(lines) == {
        2: {"gpu_memory_utilization", "max_cudagraph_capture_size"},
    }, lines
    if name.startswith("vo30"):  # musa clears a quantization config the talker never reads
        hf = {"hf_overrides.quantization_config"}
        assert _refused(problems(path, platform="musa")) == {1: hf, 2: hf}


@pytest.mark.parametrize("name", INCUMBENT)
def test_config_migrate_drops_exactly_the_refused_keys(name, tmp_path):
    text = migrated_yaml(str(FIXTURES / name))
    comment = [line for line in text.splitlines() if line.startswith("#   stage ")]
    assert {line.split(": ")[0][4:] + ": " + line.split(": ")[1] for line in comment} == {
        f"stage {sid}: {field}"
        for sid, fields in _refused(problems(FIXTURES / name, platform="cuda")).items()
        for field in fields
    }
    assert (
        "#   stage 1: enable_prefix_caching: stage 1 (talker) does not read it: its prompt" in text
    )
    assert "#   platforms.npu: stage 2: gpu_memory_utilization: stage 2 (code2wav) does not" in text
    migrated = write(tmp_path, text, "migrated.yaml")
    edited = load_deploy_config(_without_refused(name, tmp_path), platform="cuda")
    cfg = load_deploy_config(migrated, platform="cuda")
    assert cfg.pipeline == "qwen3_omni" and cfg.to_dict()["stages"] == edited.to_dict()["stages"]
    for platform in ("npu", "xpu", "rocm", "musa"):  # every platform section loads too
        load_deploy_config(migrated, platform=platform)


def test_code2wav_chunking_on_a_connector(tmp_path):
    from vllm_omni_plugin.code2wav.config import Code2WavEngineConfig

    engine = Code2WavEngineConfig(model="m")
    assert CODE2WAV_CHUNKING == {
        "initial_codec_chunk_frames": engine.first_chunk_frames,
        "codec_chunk_frames": engine.chunk_frames,
        "codec_left_context_frames": engine.left_context_frames,
    }
    text = (REPO / "stage_configs" / "qwen3_omni_tiny.yaml").read_text()
    other = text + "connectors:\n  shm:\n    type: shm\n    extra: {codec_chunk_frames: 50}\n"
    (line,) = problems(write(tmp_path, other))
    assert "connectors.shm.codec_chunk_frames: is 50, but the Code2Wav stage's chunking" in line
    # a pipeline without Code2Wav has no use for it; nor does any connector for a made-up key
    glm = (REPO / "stage_configs" / "glm_image_tiny.yaml").read_text()
    for extra, field in (
        ("codec_chunk_frames: 25", "codec_chunk_frames"),
        ("shm_dri: /x", "shm_dri"),
    ):
        bad = glm.replace("    type: shm", f"    type: shm\n    options: {{{extra}}}")
        assert bad != glm
        (line,) = problems(write(tmp_path, bad, "glm.yaml"))
        assert f"connectors.shm.{field}: not an option of the shm connector" in line, line
    assert "did you mean 'shm_dir'" in line


def test_async_chunk_warns_only_where_it_says_otherwise(tmp_path):
    base = (REPO / "stage_configs" / "qwen3_omni_tiny.yaml").read_text()
    quiet = load_deploy_config(write(tmp_path, base + "async_chunk: true\n"))
    assert not any("async_chunk" in w for w in quiet.warnings)
    loud = load_deploy_config(write(tmp_path, base + "async_chunk: false\n"))
    assert any("async_chunk: False ignored" in w and "stream" in w for w in loud.warnings)
    glm = (REPO / "stage_configs" / "glm_image_tiny.yaml").read_text()
    warned = load_deploy_config(write(tmp_path, glm + "async_chunk: true\n", "glm.yaml"))
    assert any("start after their inputs complete" in w for w in warned.warnings)
    with pytest.raises(ConfigError):  # stage overrides are refused alike
        load_deploy_config(
            "qwen3_omni_tiny", stage_overrides={"1": {"enable_prefix_caching": True}}
        )


def test_a_connector_named_for_a_streamed_edge_is_warned_about(tmp_path):
    base = (REPO / "stage_configs" / "qwen3_omni_tiny.yaml").read_text()
    assert not any("edges" in w for w in load_deploy_config(write(tmp_path, base)).warnings)
    named = base + "edges:\n  - {from: 1, to: 2, connector: shm}\nconnectors:\n  shm: {type: shm}\n"
    (warning,) = [w for w in load_deploy_config(write(tmp_path, named)).warnings if "edges" in w]
    assert "edges[0].connector: 'shm' is not used: edge 1 -> 2 streams" in warning, warning
