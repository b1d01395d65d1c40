"""Rule 10-11: the `config` CLI (real subprocess for the exit code and stderr) and bundled files."""

from __future__ import annotations

import json
import subprocess
import sys

from config_helpers import REPO, write

from vllm_omni_plugin.cli import main


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_omni_plugin.cli", "config", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env=env,
    )


def test_validate_bundled_and_acceptance_show():
    ok = _cli("validate", "stage_configs/glm_image.yaml")
    assert ok.returncode == 0, ok.stderr
    assert "glm_image" in ok.stdout
    shown = _cli(
        "show",
        "stage_configs/glm_image.yaml",
        "--format",
        "json",
        "--stage-overrides",
        '{"1": {"default_sampling_params": {"num_inference_steps": 8}}}',
    )
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    dit = data["stages"][1]
    assert dit["stage_id"] == 1
    assert dit["default_sampling_params"]["num_inference_steps"] == 8
    assert dit["default_sampling_params"]["guidance_scale"] == 1.5
    ar = data["stages"][0]
    assert ar["scheduler_cls"].endswith("OmniARAsyncScheduler") and ar["async_scheduling"] is True


def test_bundled_configs_all_validate(capsys):
    for name in ("glm_image", "glm_image_nixl", "glm_image_tiny", "qwen_image_tiny"):
        assert main(["config", "validate", name]) == 0, capsys.readouterr().err


def test_validate_errors_are_one_line_each_no_traceback(tmp_path):
    path = write(
        tmp_path,
        "pipeline: glm_image\nstages:\n  - stage_id: 0\n    tensor_parallel_size: 0\n"
        "    max_num_seq: 2\n  - stage_id: 1\n    default_sampling_params: {guidance_scale: -1}\n",
    )
    res = _cli("validate", str(path))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(f"error: {path}: stage ") for line in lines)


def test_many_errors_are_capped(tmp_path):
    body = "".join(f"    bad_key_{i}: 1\n" for i in range(40))
    path = write(tmp_path, f"pipeline: glm_image\nstages:\n  - stage_id: 0\n{body}")
    res = _cli("validate", str(path))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) <= 25 and "more problems" in lines[-1]


def test_syntax_error_and_missing_file(tmp_path, capsys):
    path = write(tmp_path, "stages:\n  - stage_id: 0\n   devices: 1\n")
    assert main(["config", "validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "YAML syntax error" in err and ": line " in err
    assert main(["config", "validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_show_yaml_provenance_and_migrate(capsys):
    assert main(["config", "show", "glm_image", "--provenance", "--model", "/m"]) == 0
    out = capsys.readouterr().out
    assert "provenance:" in out and "model_path: /m/vision_language_encoder" in out
    assert main(["config", "migrate", "tests/config/fixtures/vo16_glm_image.yaml"]) == 0
    out = capsys.readouterr().out
    assert "stages:" in out and "stage_args:" not in out


def test_every_shipped_stage_config_validates():
    # In process (one interpreter for all): a shipped file that drifts from the schema fails here.
    shipped = sorted((REPO / "stage_configs").glob("*.yaml"))
    assert len(shipped) >= 6, shipped
    for path in shipped:
        assert main(["config", "validate", str(path)]) == 0, path.name


def test_validate_says_what_a_talker_and_code2wav_stage_read(capsys):
    """The Qwen3-Omni talker (vLLM's engine in its own loop) and Code2Wav (its own engine):
    `validate` names their kinds and the settings they read, not the plugin's scheduler pair
    (the talker runs vLLM's own), and no diffusion engine lines (step_cache, lora) under
    Code2Wav; the thinker keeps its scheduler line."""
    assert main(["config", "validate", "stage_configs/qwen3_omni_tiny.yaml"]) == 0
    out = capsys.readouterr().out
    lines = {line.split(" (")[0].strip(): line for line in out.splitlines()}
    thinker, talker, code2wav = (
        lines[f"stage {i} {n}"] for i, n in enumerate(("thinker", "talker", "code2wav"))
    )
    assert "OmniARAsyncScheduler async_scheduling=True" in thinker
    assert "Scheduler" not in talker and "async_scheduling" not in talker
    assert "stage 1 talker (talker)" in talker and "reads only: dtype=float32" in talker
    assert "max_num_seqs=4 max_model_len=1024 enforce_eager=True" in talker
    assert "default_sampling_params.max_tokens=64" in talker
    assert "stage 2 code2wav (code2wav)" in code2wav
    assert "reads only: device=cpu dtype=float32 max_batch_size=4 enforce_eager=False" in code2wav
    assert "step_cache:" not in out and "lora:" not in out
