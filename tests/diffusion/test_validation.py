"""Request validation: typed errors naming the field, defaults, and capacity limits."""

from __future__ import annotations

import pytest

from vllm_omni_plugin.diffusion import (
    CapacityError,
    DiffusionEngine,
    DiffusionEngineConfig,
    GenerationRequest,
    RequestValidationError,
)


@pytest.fixture(scope="module")
def engine(tiny_models):
    return DiffusionEngine(
        DiffusionEngineConfig(
            model=str(tiny_models("qwen-image")),
            max_batch_size=4,
            max_num_inference_steps=10,
            defaults={"num_inference_steps": 3, "guidance_scale": 2.0, "height": 64, "width": 96},
        )
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"height": 65}, "height"),  # not a multiple of 16
        ({"width": 8}, "width"),  # below the minimum
        ({"width": 4096}, "width"),  # above the maximum
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": 11}, "num_inference_steps"),  # above the configured max
        ({"guidance_scale": -1.0}, "guidance_scale"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"n": 0}, "n"),
        ({"seed": -3}, "seed"),
        ({"negative_prompt": 5}, "negative_prompt"),
    ],
)
def test_invalid_fields_are_typed(engine, kwargs, field):
    args = {"request_id": "v", "prompt": "a cat", **kwargs}
    with pytest.raises(RequestValidationError) as e:
        engine.validate(GenerationRequest(**args))
    assert e.value.field == field
    assert field in str(e.value)
    assert not engine.has_unfinished()  # nothing was queued


def test_defaults_come_from_stage_config_then_diffusers(engine):
    r = engine.validate(GenerationRequest("d", "a cat"))
    assert (r.height, r.width, r.num_inference_steps, r.guidance_scale) == (64, 96, 3, 2.0)
    assert r.n == 1 and r.negative_prompt is None
    bare = DiffusionEngine(DiffusionEngineConfig(model=engine.config.model), adapter=engine.adapter)
    r = bare.validate(GenerationRequest("d", "a cat"))
    # QwenImagePipeline's own defaults: 1024x1024 (128 x vae scale 8), 50 steps, true_cfg 4.0.
    assert (r.height, r.width, r.num_inference_steps, r.guidance_scale) == (1024, 1024, 50, 4.0)


def test_request_that_can_never_fit_is_rejected(engine):
    with pytest.raises(CapacityError) as e:
        engine.validate(GenerationRequest("big", "a cat", n=5))
    assert e.value.field == "n"
    # A memory budget just above the weights leaves no room for a 1024x1024 image.
    tight = DiffusionEngine(
        DiffusionEngineConfig(
            model=engine.config.model, memory_budget_gb=engine.adapter.weight_bytes() / 2**30 + 0.05
        ),
        adapter=engine.adapter,
    )
    with pytest.raises(CapacityError, match="memory_budget_gb"):
        tight.validate(GenerationRequest("big", "a cat", height=1024, width=1024))
    tight.validate(GenerationRequest("small", "a cat", height=64, width=64))


def test_duplicate_and_abort(engine):
    engine.add_request(GenerationRequest("a1", "a cat", height=64, width=64, seed=1))
    with pytest.raises(RequestValidationError) as e:
        engine.add_request(GenerationRequest("a1", "a dog"))
    assert e.value.field == "request_id"
    engine.add_request(GenerationRequest("a2", "a red cube", height=64, width=64, seed=2))
    engine.step()
    assert engine.progress("a1") == (1, 3)
    assert engine.abort("a1")
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["a1"].error == "aborted" and outs["a1"].images == []
    assert outs["a2"].error is None and len(outs["a2"].images) == 1
    assert not engine.abort("missing")


def test_engine_config_from_typed_stage_config(engine, tiny_models):
    from vllm_omni_plugin.config import load_deploy_config

    model = str(tiny_models("qwen-image"))
    cfg = load_deploy_config("qwen_image_tiny", model=model)
    (stage,) = [s for s in cfg.stages if s.kind == "diffusion"]
    ecfg = DiffusionEngineConfig.from_stage_config(stage)
    assert (ecfg.device, ecfg.dtype, ecfg.max_batch_size) == ("cpu", "float32", 4)
    staged = DiffusionEngine(ecfg, adapter=engine.adapter)
    r = staged.validate(GenerationRequest("s", "a cat"))
    assert (r.height, r.width, r.num_inference_steps) == (64, 64, 2)  # the YAML's defaults
    with pytest.raises(RequestValidationError) as e:
        staged.validate(GenerationRequest("s", "a cat", height=2048))  # above the YAML's max
    assert e.value.field == "height"
