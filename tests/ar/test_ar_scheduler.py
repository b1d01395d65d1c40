"""Scheduler pairing and plugin registration (cheap: no engine start-up)."""

from __future__ import annotations

import importlib.metadata

import pytest


def test_register_is_idempotent_and_lazy():
    from vllm import ModelRegistry
    from vllm_omni_plugin.entry_points.general import register

    register()
    register()
    assert "GlmImageForConditionalGeneration" in ModelRegistry.get_supported_archs()
    assert "Qwen3OmniTalkerForCodecGeneration" in ModelRegistry.get_supported_archs()
    # The grid logits processor goes to the GLM-Image AR engine only, never through vLLM's
    # entry-point group (whose presence alone turns off vLLM 0.26-0.30's model runner V2 for
    # every engine, e.g. a plain `vllm serve` of another model).
    ours = [
        ep
        for ep in importlib.metadata.entry_points(group="vllm.logits_processors")
        if ep.value.startswith("vllm_omni_plugin")
    ]
    assert ours == []
    from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR
    from vllm_omni_plugin.pipelines.glm_image import GLM_IMAGE

    assert GLM_IMAGE.stages[0].logits_processors == (LOGITS_PROCESSOR,)


def test_sync_scheduler_refuses_async_config(glm_tiny):
    """What EngineCore does with the resolved config: resolve the class, construct it."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_omni_plugin.core.sched import OmniARAsyncScheduler, OmniARScheduler

    config = EngineArgs(
        model=glm_tiny.ar,
        tokenizer=glm_tiny.processor,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        scheduler_cls="vllm_omni_plugin.core.sched.OmniARScheduler",
    ).create_engine_config()
    assert config.scheduler_config.get_scheduler_cls() is OmniARScheduler
    config.scheduler_config.async_scheduling = True  # what a GPU platform keeps on
    with pytest.raises(ValueError, match="OmniARAsyncScheduler"):
        OmniARScheduler(vllm_config=config, kv_cache_config=None, structured_output_manager=None)
    assert issubclass(OmniARAsyncScheduler, OmniARScheduler.__mro__[1])  # the shared mixin
