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
    # The logits processor reaches every engine through its entry point (no engine flag needed).
    group = importlib.metadata.entry_points(group="vllm.logits_processors")
    assert any(
        ep.value == "vllm_omni_plugin.models.glm_image.logits:ImageGridLogitsProcessor"
        for ep in group
    )


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
