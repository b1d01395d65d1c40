"""entry_points/patches.py: flags are listed, serve patches install only with --stage-config,
delegate to vLLM otherwise, and refuse an unknown vLLM version with a clear error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
from vllm_omni_plugin.entry_points import patches

# Runs in a fresh interpreter so that no other test has installed anything yet.
_PROBE = textwrap.dedent(
    """
    import sys
    from vllm.entrypoints.launchers.api_server import entry
    import vllm.plugins as vp
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm_omni_plugin.entry_points import patches

    originals = (entry.build_async_engine_client, entry.init_app_state, vp.load_endpoint_plugins)
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(["some/model"])
    assert args.stage_config is None and args.stage_overrides is None
    assert not patches.serve_patches_installed()
    now = (entry.build_async_engine_client, entry.init_app_state, vp.load_endpoint_plugins)
    assert now == originals, "plain vllm serve must leave vLLM's functions untouched"
    assert vp.load_endpoint_plugins(("generate",)) == []  # VLLM_PLUGINS unset: stock

    if sys.argv[1] == "bad-version":
        patches.vllm_version = lambda: "0.99.0"
        parser.parse_args(["m", "--stage-config", "x.yaml"])  # must exit with a clear error
        raise SystemExit("not reached")

    args = parser.parse_args(["m", "--stage-config", "x.yaml", "--stage-overrides", "{}",
                              "--stage-ids", "0", "--omni-master-port", "7000"])
    assert args.stage_config == "x.yaml" and args.omni_master_port == 7000
    assert patches.serve_patches_installed()
    assert entry.build_async_engine_client.__wrapped__ is originals[0]
    assert entry.init_app_state.__wrapped__ is originals[1]
    # Not serving a pipeline in this process: the endpoint-plugin patch still behaves as stock.
    assert vp.load_endpoint_plugins(("generate",)) == []
    print("PROBE-OK")
    """
)


def _probe(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=300
    )


def test_serve_patches_only_with_stage_config():
    proc = _probe("ok")
    assert proc.returncode == 0 and "PROBE-OK" in proc.stdout, proc.stderr[-3000:]


def test_unknown_vllm_version_is_a_clear_cli_error():
    proc = _probe("bad-version")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "checked on vLLM 0.26 to 0.33, but vLLM 0.99.0 is installed" in proc.stderr


def test_version_guard(monkeypatch):
    monkeypatch.delenv(patches.ALLOW_UNTESTED_ENV, raising=False)
    for version in ("0.26.0", "0.26.1+cu130", "0.29.0", "0.32.0+cpu", "0.33.1+cu130"):
        monkeypatch.setattr(patches, "vllm_version", lambda v=version: v)
        patches.check_vllm_version()
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.26.0")
    assert patches.serve_seams().api_server == "vllm.entrypoints.openai.api_server"
    monkeypatch.setattr(patches, "vllm_version", lambda: "0.29.0")
    assert patches.serve_seams().api_server == "vllm.entrypoints.launchers.api_server.entry"
    for version in ("0.25.2", "0.34.0", "1.0.0"):
        monkeypatch.setattr(patches, "vllm_version", lambda v=version: v)
        with pytest.raises(patches.OmniPatchError, match=version.replace(".", r"\.")):
            patches.check_vllm_version()
    monkeypatch.setenv(patches.ALLOW_UNTESTED_ENV, "1")
    patches.check_vllm_version()


def test_help_lists_the_flags():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    text = parser.format_help()
    assert "OmniStageConfig" in text
    for flag in (
        "--stage-config",
        "--stage-overrides",
        "--stage-ids",
        "--omni-master-address",
        "--omni-master-port",
    ):
        assert flag in text
        assert any(flag in a.option_strings for a in parser._actions)


def test_endpoint_plugin_is_inert_without_stage_config():
    from argparse import Namespace

    from fastapi import FastAPI
    from vllm_omni_plugin.entry_points.endpoints import make_plugin

    plugin = make_plugin()
    assert plugin.name == patches.ENDPOINT_PLUGIN_NAME and plugin.required_tasks is None
    app = FastAPI()
    app.state.args = Namespace(stage_config=None)
    before = len(app.routes)
    plugin.attach_router(app)
    assert len(app.routes) == before
    app.state.args = Namespace(stage_config="x.yaml")
    plugin.attach_router(app)
    paths = {getattr(r, "path", None) for r in app.routes}
    assert {"/v1/images/generations", "/v1/images/files/{token}", "/v1/chat/completions"} <= paths


def test_callers_must_look_patched_names_up_at_call_time():
    from vllm.entrypoints.launchers.api_server import entry

    # vLLM as installed: both callers resolve the patched names as module globals.
    patches._require_global_call(entry.run_server_worker, "build_async_engine_client")
    patches._require_global_call(entry.build_and_serve, "init_app_state")

    bound = entry.build_async_engine_client

    def caller_binding_early(args):  # what a vLLM that bound the name at import would do
        return bound(args)

    with pytest.raises(patches.OmniPatchError, match="no longer calls build_async_engine_client"):
        patches._require_global_call(caller_binding_early, "build_async_engine_client")


PATCH7_PROBE = """
import sys
from vllm_omni_plugin.entry_points import patches
installed = patches.install_torchvision_free_qwen2_vl()
print("installed", installed)
if installed:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil
    assert smart_resize is pil.smart_resize
    import importlib
    auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    cls = auto.video_processor_class_from_name("Qwen2VLVideoProcessor")
    from vllm_omni_plugin.models.qwen3_omni import video_processor
    import numpy as np
    frames = np.random.default_rng(0).integers(0, 256, (4, 60, 90, 3), dtype=np.uint8)
    out = cls().preprocess([frames], return_tensors="pt")
    print("video", cls is video_processor.Qwen2VLVideoProcessor, out["video_grid_thw"].tolist())
else:
    print("module", patches._QWEN2_VL_IMAGE_PROCESSING in sys.modules)
"""


def _patch7(env_value: str | None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != patches.STAGE_PIPELINE_ENV}
    if env_value is not None:
        env[patches.STAGE_PIPELINE_ENV] = env_value
    out = subprocess.run(
        [sys.executable, "-c", PATCH7_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("torchvision") is not None, reason="patch 7 is inert with torchvision"
)
def test_patch7_only_in_a_stage_pipeline():
    """Outside a stage pipeline nothing is touched; inside one the Qwen2-VL image module is
    the PIL one's `smart_resize` and the checkpoint's video processor name loads the torch-only
    one, which turns 4 frames of 60x90 into a 2 x 20 x 28 grid of patches: frames paired, and
    resized up to the default least area (128 * 28 * 28 pixels) in multiples of 28: 280x392."""
    assert _patch7(None).split() == ["installed", "False", "module", "False"]
    out = _patch7("1")
    assert out.split()[:4] == ["installed", "True", "video", "True"], out
    assert out.strip().endswith("[[2, 20, 28]]"), out
