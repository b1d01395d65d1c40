"""vLLM-Omni 0.26 (the incumbent) as the benchmarks serve it: as it ships, and tuned the way its
users would tune it for a steady load at concurrency 8. Every change from the shipped form is a
`Change` with its reason, written beside the results, so a reader sees exactly what was changed.

GLM-Image: vLLM-Omni ships `deploy/glm_image.yaml` (AR on GPU 0, DiT on GPU 1). Both forms move
the DiT to GPU 0 and make the two changes random weights need (`shipped_glm_deploy`). The tuned
form then matches our one-GPU layout (`stage_configs/glm_image_1gpu.yaml`):
  - AR `max_num_seqs` 1 -> ours (8): it batches decode as ours does;
  - DiT `enforce_eager` true -> false: its diffusion runner then compiles the transformer's
    repeated blocks (`diffusion_compile_granularity` "regional", its default);
  - AR `gpu_memory_utilization` 0.6 -> ours (0.35): the same share of the GPU as our AR.
  Its DiT keeps `max_num_seqs` 1: vLLM-Omni's GLM-Image pipeline declares no request or step
  batching (`supports_request_batch` / `supports_step_execution` are not set on it).

Qwen-Image: vLLM-Omni ships no deploy file for it; it serves `vllm serve MODEL --omni` with its
diffusion defaults (one request at a time, transformer compiled regionally). Tuned: step
batching on (`--step-execution`, its step-level batching) with `--max-num-seqs` = the load's
concurrency (8).

Qwen3-Omni: vLLM-Omni ships `deploy/qwen3_omni_moe.yaml` (thinker on GPU 0, talker and Code2Wav
on GPU 1, three vLLM engines). `qwen3_omni_one_gpu_deploy` moves every stage to GPU 0 with memory
shares that fit one GPU together and caps the talker's frames (the benchmark's fixed audio
length); everything else stays as shipped (`bench_omni_speech.py`).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# vLLM-Omni 0.26.0's `StageDeployConfig` fields that the tuned files touch (vllm_omni/config/
# stage_config.py); keys it does not know go to `engine_extras` silently, so a typo would be
# accepted and ignored. On the GPU machine `validate_deploy` reads the installed class instead.
KNOWN_STAGE_FIELDS = frozenset(
    {
        "stage_id",
        "devices",
        "gpu_memory_utilization",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enforce_eager",
        "step_execution",
        "diffusion_compile_granularity",
        "default_sampling_params",
        "logits_processors",  # vLLM engine arg (passed through engine_extras to the AR engine)
        "trust_remote_code",
        "enable_prefix_caching",
        "enable_chunked_prefill",  # vLLM engine arg (Qwen3-Omni's Code2Wav stage)
        "max_model_len",  # vLLM engine arg (Qwen3-Omni's thinker on one 80 GB GPU)
        "async_scheduling",
        "input_connectors",
    }
)
# vLLM engine args the AR stage takes through engine_extras on purpose (not StageDeployConfig).
ENGINE_PASSTHROUGH = frozenset(
    {
        "logits_processors",
        "trust_remote_code",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "max_model_len",  # Qwen3-Omni on one 80 GB GPU (QWEN3_OMNI_80GB_FIT)
    }
)


@dataclass(frozen=True)
class Change:
    """One setting changed from the shipped deploy."""

    where: str  # "stage 0 max_num_seqs", or a CLI flag
    shipped: Any
    tuned: Any
    why: str


def _stage(cfg: dict, stage_id: int) -> dict:
    for stage in cfg["stages"]:
        if stage["stage_id"] == stage_id:
            return stage
    raise KeyError(f"deploy has no stage {stage_id}")


def shipped_glm_deploy(src: dict, size: int, logits_processor: str) -> tuple[dict, list[Change]]:
    """vLLM-Omni's glm_image.yaml on one GPU, plus what random weights need: the AR's
    max_tokens set to the grid (random weights never emit EOS; trained ones stop right after
    the grid) and the checkpoint's sequence_bias applied through our grid logits processor
    (vLLM ignores generation_config's sequence_bias; diffusers' transformers applies it)."""
    from vllm_omni_plugin.families.glm_image.processing import num_image_tokens

    cfg = copy.deepcopy(src)
    changes = []
    for stage in cfg["stages"]:
        if str(stage.get("devices")) != "0":
            changes.append(
                Change(f"stage {stage['stage_id']} devices", stage.get("devices"), "0", "one GPU")
            )
            stage["devices"] = "0"
    ar = _stage(cfg, 0)
    params = ar.setdefault("default_sampling_params", {})
    grid = num_image_tokens(size, size) + 1
    changes.append(
        Change(
            "stage 0 max_tokens", params.get("max_tokens"), grid, "random weights never emit EOS"
        )
    )
    params["max_tokens"] = grid
    changes.append(
        Change("stage 0 logits_processors", ar.get("logits_processors"), [logits_processor],
               "the checkpoint's sequence_bias, as transformers applies it")
    )  # fmt: skip
    ar["logits_processors"] = [logits_processor]
    return cfg, changes


def tuned_glm_deploy(shipped: dict, ours: dict) -> tuple[dict, list[Change]]:
    """The shipped one-GPU deploy tuned to our one-GPU stage config `ours` (its resolved
    stages as dicts): AR batch and memory share equal to ours, DiT compiled."""
    cfg = copy.deepcopy(shipped)
    ar, dit = _stage(cfg, 0), _stage(cfg, 1)
    ours_ar = _stage(ours, 0)
    wanted = [
        (ar, 0, "max_num_seqs", ours_ar["max_num_seqs"], "AR decodes as many requests together as ours"),
        (ar, 0, "gpu_memory_utilization", ours_ar["gpu_memory_utilization"], "the AR's GPU share equal to ours"),
        (dit, 1, "enforce_eager", False, "its DiT compiled (regional, its default granularity), as ours"),
    ]  # fmt: skip
    changes = []
    for stage, sid, key, value, why in wanted:
        if stage.get(key) != value:
            changes.append(Change(f"stage {sid} {key}", stage.get(key), value, why))
            stage[key] = value
    return cfg, changes


def qwen_image_argv(model: str, tuned: bool, batch: int) -> tuple[list[str], list[Change]]:
    """`vllm serve` arguments for vLLM-Omni's Qwen-Image (no deploy file ships for it); tuned:
    step batching of up to `batch` requests (the load's concurrency)."""
    argv = [model, "--omni"]
    if not tuned:
        return argv, []
    argv += ["--step-execution", "--max-num-seqs", str(batch)]
    return argv, [
        Change("--step-execution", False, True, "its step-level batching on"),
        Change(
            "--max-num-seqs", 1, batch, "as many requests in a step as the load keeps in flight"
        ),
    ]


# Qwen3-Omni's stages on one GPU: vLLM-Omni's engines each take `gpu_memory_utilization` of the
# whole device (a stage starting after another is capped to what is free), so the shares must
# sum below 1 with room for three CUDA contexts. Thinker: ~59 GiB of bf16 weights plus KV cache
# and graphs in 0.6 of an H200 (~84 GiB; it ships with 0.9 of an 80 GB GPU, 72 GB); talker: ~6 GiB
# of weights in 0.2 (~28 GiB); Code2Wav keeps its shipped 0.1 (~14 GiB, more than the 8 GB it
# ships with). 0.9 in all.
QWEN3_OMNI_ONE_GPU_SHARES = {0: 0.6, 1: 0.2, 2: 0.1}
# The same on one 80 GB GPU (H100), as our qwen3_omni_1gpu's 80 GB settings: the thinker's ~59 GiB
# of weights leave ~4 GiB of its 0.79 for activations and KV cache, enough for 4096-token
# sequences and steps (shipped: the model's 65536 positions, steps of 32768, whose profile run
# alone would not fit); the talker's steps the same; Code2Wav's share 0.05 (~4 GiB).
QWEN3_OMNI_80GB_SHARES = {0: 0.79, 1: 0.105, 2: 0.05}
QWEN3_OMNI_80GB_FIT = {
    0: {"max_model_len": 4096, "max_num_batched_tokens": 4096},
    # the talker's KV at its shipped 65536 tokens does not fit its 0.105 share of 80 GB
    # (1.25 GiB needed, 1.15 GiB left on an H100, 2026-12-07); a talker prompt is the thinker's
    # prompt plus the frames, so the thinker's 4096 bounds it
    1: {"max_model_len": 4096, "max_num_batched_tokens": 4096},
}
QWEN3_OMNI_TALKER = 1
# vLLM-Omni 0.26's talker voiced max_tokens - 1 frames (243,285 samples = 127 x 1920 - 555 for
# max_tokens 128, every answer of the first H200 round): one more token gives both sides N frames.
QWEN3_OMNI_TALKER_EXTRA_TOKENS = 1


def qwen3_omni_one_gpu_deploy(
    src: dict,
    frames: int,
    shares: dict[int, float] | None = None,
    fit: dict[int, dict[str, Any]] | None = None,
) -> tuple[dict, list[Change]]:
    """vLLM-Omni's qwen3_omni_moe.yaml (`src`, as loaded) on GPU 0: every stage's `devices` "0",
    the memory `shares` (default QWEN3_OMNI_ONE_GPU_SHARES), and the talker's
    `default_sampling_params.max_tokens` = `frames` + QWEN3_OMNI_TALKER_EXTRA_TOKENS (`frames`
    codec frames of 80 ms: the fixed audio length both systems get). The thinker's length comes with each
    request (`max_tokens` + `ignore_eos`, which vLLM-Omni applies to its thinker stage); the
    `platforms:` sections (NPU, ROCm, XPU) and everything else stay as shipped.

    `fit` ({stage id: {field: value}}, after the shares) sets what a GPU smaller than the
    H200 needs for the three engines to fit (QWEN3_OMNI_80GB_FIT), each a Change."""
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    shares = QWEN3_OMNI_ONE_GPU_SHARES if shares is None else shares
    cfg = copy.deepcopy(src)
    changes = []
    for stage in cfg["stages"]:
        sid = stage["stage_id"]
        if str(stage.get("devices")) != "0":
            changes.append(Change(f"stage {sid} devices", stage.get("devices"), "0", "one GPU"))
            stage["devices"] = "0"
        share = shares[sid]
        if stage.get("gpu_memory_utilization") != share:
            why = f"the three stages' shares sum to {sum(shares.values()):.2f} of one GPU"
            changes.append(
                Change(f"stage {sid} gpu_memory_utilization", stage.get("gpu_memory_utilization"),
                       share, why)
            )  # fmt: skip
            stage["gpu_memory_utilization"] = share
    for sid, fields in (fit or {}).items():
        stage = _stage(cfg, sid)
        for key, value in fields.items():
            if stage.get(key) != value:
                changes.append(Change(f"stage {sid} {key}", stage.get(key), value,
                                      "the three engines fit one GPU of this size"))  # fmt: skip
                stage[key] = value
    talker = _stage(cfg, QWEN3_OMNI_TALKER)
    params = talker.setdefault("default_sampling_params", {})
    tokens = frames + QWEN3_OMNI_TALKER_EXTRA_TOKENS
    changes.append(
        Change(f"stage {QWEN3_OMNI_TALKER} max_tokens", params.get("max_tokens"), tokens,
               f"the fixed audio length: {frames} codec frames (80 ms each); its talker's "
               f"max_tokens counts {QWEN3_OMNI_TALKER_EXTRA_TOKENS} more than the frames it "
               "voices (128 gave 127 frames on the H200, 2026-12-03)")
    )  # fmt: skip
    params["max_tokens"] = tokens
    return cfg, changes


def installed_stage_fields(omni_path: str | None = None) -> frozenset[str] | None:
    """The installed vLLM-Omni's StageDeployConfig field names (from `omni_path` when given: the
    GPU kit installs it in a folder of its own), None when it is not importable."""
    import sys

    if omni_path and omni_path not in sys.path:
        sys.path.append(omni_path)
    try:
        from dataclasses import fields

        from vllm_omni.config.stage_config import StageDeployConfig
    except Exception:  # not installed here (CPU dev machine: vLLM-Omni needs vLLM 0.26)
        return None
    return frozenset(f.name for f in fields(StageDeployConfig))


def validate_deploy(cfg: dict, fields: frozenset[str] | None = None) -> list[str]:
    """Problems with a deploy dict (empty: valid): stage ids unique, every stage key one the
    incumbent knows (`fields`, else KNOWN_STAGE_FIELDS plus our pass-through engine args),
    devices on GPU 0, shares in (0, 1] and together at most 0.95, batch sizes >= 1."""
    known = (fields | ENGINE_PASSTHROUGH) if fields is not None else KNOWN_STAGE_FIELDS
    problems = []
    ids = [s.get("stage_id") for s in cfg.get("stages", [])]
    if len(ids) != len(set(ids)) or not ids:
        problems.append(f"stage ids must be unique and present, got {ids}")
    for stage in cfg.get("stages", []):
        sid = stage.get("stage_id")
        for key in stage:
            if key not in known:
                problems.append(f"stage {sid}: unknown key {key!r} (would be ignored)")
        share = stage.get("gpu_memory_utilization")
        if share is not None and not 0 < share <= 1:
            problems.append(f"stage {sid}: gpu_memory_utilization {share} not in (0, 1]")
        seqs = stage.get("max_num_seqs")
        if seqs is not None and (not isinstance(seqs, int) or seqs < 1):
            problems.append(f"stage {sid}: max_num_seqs {seqs!r} must be an int >= 1")
        if str(stage.get("devices", "0")) != "0":
            problems.append(f"stage {sid}: devices {stage.get('devices')!r}, expected GPU 0")
    total = sum(s.get("gpu_memory_utilization") or 0 for s in cfg.get("stages", []))
    if total > 0.95:  # every stage on GPU 0: their shares must leave room for CUDA contexts
        problems.append(f"gpu_memory_utilization sums to {total:.2f} on GPU 0 (> 0.95)")
    return problems


def reserved_share(cfg: dict) -> dict[str, float | None]:
    """Each stage's configured GPU share (None: the stage sets none and takes what it uses)."""
    return {f"stage_{s['stage_id']}": s.get("gpu_memory_utilization") for s in cfg["stages"]}


def write_deploys(out: Path, shipped: dict, tuned: dict, changes: list[Change]) -> dict:
    """Write both deploy files and the change list; return their paths and the changes."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    paths = {"shipped": out / "omni_shipped.yaml", "tuned": out / "omni_tuned.yaml"}
    paths["shipped"].write_text(yaml.safe_dump(shipped, sort_keys=False))
    paths["tuned"].write_text(yaml.safe_dump(tuned, sort_keys=False))
    return {k: str(v) for k, v in paths.items()} | {"changes": [asdict(c) for c in changes]}
