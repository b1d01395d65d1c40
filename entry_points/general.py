"""`vllm.general_plugins` hook: runs in every vLLM process (API server, EngineCore, workers).

Keep it idempotent and cheap: it runs in every process vLLM starts, so register by dotted name
only and import nothing heavy. Each step below is a small guarded function (model registry, CLI
flags, the AR scheduler pairing check, the NIXL KV connector, stage-process patches), safe to run twice.
"""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    _register_models()
    _install_cli_flags()
    _install_scheduler_check()
    _register_kv_connector()
    _install_pipeline_process_patches()


def _register_models() -> None:
    from vllm import ModelRegistry

    from vllm_omni_plugin.families.qwen3_omni import TALKER_ARCH, TALKER_CLASS
    from vllm_omni_plugin.models.glm_image import MODEL_ARCH, MODEL_CLASS

    # Lazy "module:Class" form: the model module (torch kernels) loads only when used.
    supported = ModelRegistry.get_supported_archs()
    for arch, cls in ((MODEL_ARCH, MODEL_CLASS), (TALKER_ARCH, TALKER_CLASS)):
        if arch not in supported:
            ModelRegistry.register_model(arch, cls)


def _install_cli_flags() -> None:
    # Adds --stage-config & co. to vLLM's parsers; the serve patches install only when
    # --stage-config is actually given (see entry_points/patches.py).
    from vllm_omni_plugin.entry_points.patches import install_cli_flags

    install_cli_flags()


def _install_scheduler_check() -> None:
    # Refuses a synchronous AR scheduler under async scheduling once the engine's config is
    # built, before any model loads (patch 8, entry_points/patches.py).
    from vllm_omni_plugin.entry_points.patches import install_scheduler_check

    install_scheduler_check()


def _register_kv_connector() -> None:
    # NIXL stage connector as vLLM KV connector "OmniStageNixlConnector" (guarded: no-op if known).
    from vllm_omni_plugin.connectors import register_kv_connector

    register_kv_connector()


def _install_pipeline_process_patches() -> None:
    # Patch 7 (entry_points/patches.py) in the processes of a stage pipeline: inert elsewhere.
    from vllm_omni_plugin.entry_points.patches import install_torchvision_free_qwen2_vl

    install_torchvision_free_qwen2_vl()
