"""Per-request family knobs (diffusion/knobs.py) in the engine: each one applied equals
diffusers' pipeline given the same knob (same tiny checkpoint, same seed), and changes the
output against the request without it; a knob a request sets that the model would ignore is
refused naming it.

Tolerance: mean absolute pixel difference <= 1/255 for images (seen: 0.0); videos at most 1/255
per pixel and a mean under 0.05/255 (seen: 0.0). "Changed": a mean difference above 0.02/255
(random tiny weights respond weakly to guidance: seen 0.04-0.5; the same request twice: 0.0).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
SIZE = 64
MAX_IMAGE_DIFF = 1.0
CHANGED = 0.02


def image_req(rid, seed=3, negative="blurry", knobs=None, guidance=None, steps=2):
    return GenerationRequest(
        rid,
        "a red cube",
        negative_prompt=negative,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=guidance,
        seed=seed,
        knobs=dict(knobs or {}),
    )


def generate(engine, r):
    (out,) = engine.generate([r])
    assert out.error is None, out.error
    return out.images


def refused(engine, r) -> str:
    with pytest.raises(RequestValidationError) as info:
        engine.validate(r)
    return info.value.field


# ---- Qwen-Image: true_cfg_scale --------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen(tiny_models):
    from diffusers import QwenImagePipeline

    model = str(tiny_models("qwen-image"))
    pipe = QwenImagePipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return DiffusionEngine(DiffusionEngineConfig(model=model, max_batch_size=4)), pipe


def test_qwen_true_cfg_scale_equals_diffusers_and_changes_the_image(qwen, pixel_diff):
    engine, pipe = qwen
    r = image_req("q", knobs={"true_cfg_scale": 2.5})
    got = generate(engine, r)[0]
    want = pipe(
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=2.5,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(r.seed),
    ).images[0]
    assert pixel_diff(got, want) <= MAX_IMAGE_DIFF
    default = generate(engine, image_req("q0"))[0]  # diffusers' default scale, 4.0
    assert pixel_diff(got, default) > CHANGED


def test_qwen_true_cfg_scale_refusals_name_the_field(qwen):
    engine, _ = qwen
    # No negative prompt: diffusers runs no true CFG and would ignore the scale.
    assert refused(engine, image_req("a", negative=None, knobs={"true_cfg_scale": 3})) == (
        "true_cfg_scale"
    )
    # guidance_scale: diffusers reads it only on a guidance-distilled transformer (not this
    # one), with or without a negative prompt or true_cfg_scale.
    assert refused(engine, image_req("b", negative=None, guidance=4.0)) == "guidance_scale"
    assert refused(engine, image_req("b", guidance=3.0)) == "guidance_scale"
    both = image_req("b", knobs={"true_cfg_scale": 3}, guidance=3.0)
    assert refused(engine, both) == "guidance_scale"
    # A negative prompt without true CFG (scale <= 1) would be ignored.
    assert refused(engine, image_req("c", knobs={"true_cfg_scale": 1.0})) == "negative_prompt"
    assert refused(engine, image_req("d", knobs={"true_cfg_scale": -1})) == "true_cfg_scale"
    assert refused(engine, image_req("e", knobs={"flow_shift": 3.0})) == "flow_shift"


def test_qwen_stage_refuses_a_default_guidance_scale_it_would_not_read(qwen):
    """A stage default guidance_scale beside true_cfg_scale on a transformer without embedded
    guidance is refused when the stage loads (also for a hub id, whose config the deploy check
    cannot read), naming the field; alone it stands for true_cfg_scale."""
    from vllm_omni_plugin.diffusion.adapters.qwen_image import QwenImageAdapter
    from vllm_omni_plugin.diffusion.errors import DiffusionEngineError

    _, pipe = qwen
    cpu = torch.device("cpu")
    with pytest.raises(DiffusionEngineError, match=r"default_sampling_params\.guidance_scale"):
        QwenImageAdapter(pipe, cpu, torch.float32, {"guidance_scale": 3.0, "true_cfg_scale": 4.0})
    assert QwenImageAdapter(pipe, cpu, torch.float32, {"guidance_scale": 3.0}).true_cfg_scale == 3.0


# ---- FLUX: true_cfg_scale ----------------------------------------------------------------------
def test_flux_true_cfg_scale_equals_diffusers(tiny_models, pixel_diff):
    from diffusers import FluxPipeline

    model = str(tiny_models("flux"))
    engine = DiffusionEngine(DiffusionEngineConfig(model=model, max_batch_size=4))
    pipe = FluxPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    r = image_req("f", knobs={"true_cfg_scale": 3.0}, guidance=3.5)
    got = generate(engine, r)[0]
    want = pipe(
        r.prompt,
        negative_prompt=r.negative_prompt,
        true_cfg_scale=3.0,
        guidance_scale=3.5,
        height=SIZE,
        width=SIZE,
        num_inference_steps=r.num_inference_steps,
        generator=torch.Generator("cpu").manual_seed(r.seed),
    ).images[0]
    assert pixel_diff(got, want) <= MAX_IMAGE_DIFF
    # The stage default (1.0) runs no true CFG, so a bare negative prompt would be ignored.
    assert refused(engine, image_req("f0", guidance=3.5)) == "negative_prompt"
    plain = generate(engine, image_req("f1", negative=None, guidance=3.5))[0]
    assert pixel_diff(got, plain) > CHANGED


# ---- Wan2.2: guidance_scale_2, boundary_ratio, flow_shift -------------------------------------
WAN_SIZE, FRAMES, STEPS = 32, 5, 6


@pytest.fixture(scope="module")
def wan(tiny_models):
    from diffusers import WanPipeline

    model = str(tiny_models("wan"))
    pipe = WanPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    return DiffusionEngine(DiffusionEngineConfig(model=model, max_batch_size=4)), pipe


def video_req(rid, knobs=None, guidance=5.0, **kw):
    return GenerationRequest(
        rid,
        "a red cat",
        height=WAN_SIZE,
        width=WAN_SIZE,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        seed=4,
        num_frames=FRAMES,
        knobs=dict(knobs or {}),
        **kw,
    )


def frames(images) -> np.ndarray:
    return np.stack([np.asarray(f.convert("RGB"), dtype=np.float64) for f in images])


def wan_reference(pipe, r, **call) -> np.ndarray:
    out = pipe(
        r.prompt,
        height=r.height,
        width=r.width,
        num_frames=r.num_frames,
        num_inference_steps=r.num_inference_steps,
        guidance_scale=r.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(r.seed),
        output_type="pil",
        **call,
    ).frames[0]
    return frames(out)


def assert_same_video(got: np.ndarray, want: np.ndarray) -> None:
    diff = np.abs(got - want)
    assert diff.max() <= 1.0 and diff.mean() <= 0.05, (diff.max(), diff.mean())


@pytest.fixture(scope="module")
def wan_default(wan):
    engine, _ = wan
    return frames(generate(engine, video_req("w0")))


def test_wan_guidance_scale_2_equals_diffusers(wan, wan_default):
    engine, pipe = wan
    r = video_req("g2", {"guidance_scale_2": 1.5})
    got = frames(generate(engine, r))
    assert_same_video(got, wan_reference(pipe, r, guidance_scale_2=1.5))
    assert np.abs(got - wan_default).mean() > CHANGED


def test_wan_boundary_ratio_equals_diffusers(wan, wan_default):
    engine, pipe = wan
    r = video_req("br", {"boundary_ratio": 0.5})
    got = frames(generate(engine, r))
    before = pipe.config.boundary_ratio
    pipe.register_to_config(boundary_ratio=0.5)  # diffusers reads it from the pipeline config
    try:
        want = wan_reference(pipe, r)
    finally:
        pipe.register_to_config(boundary_ratio=before)
    assert_same_video(got, want)
    assert np.abs(got - wan_default).mean() > CHANGED


def test_wan_flow_shift_equals_diffusers(wan, wan_default):
    engine, pipe = wan
    r = video_req("fs", {"flow_shift": 8.0})
    got = frames(generate(engine, r))
    before = pipe.scheduler
    pipe.scheduler = type(before).from_config(before.config, flow_shift=8.0)
    try:
        want = wan_reference(pipe, r)
    finally:
        pipe.scheduler = before
    assert_same_video(got, want)
    assert np.abs(got - wan_default).mean() > CHANGED


def test_wan_knobs_batch_with_each_other(wan):
    """Requests with different knobs share the engine (each its own schedule and expert) and
    each still gets what it gets alone."""
    engine, _ = wan
    rs = [video_req("m1", {"flow_shift": 8.0}), video_req("m2", {"boundary_ratio": 0.5})]
    together = {o.request_id: frames(o.images) for o in engine.generate(rs)}
    for r in rs:
        alone = frames(generate(engine, video_req(r.request_id + "a", r.knobs)))
        assert_same_video(together[r.request_id], alone)


def test_wan_refusals_name_the_field(wan):
    engine, _ = wan
    # CFG off (guidance_scale <= 1): the low-noise scale and a negative prompt would be ignored.
    assert refused(engine, video_req("x", {"guidance_scale_2": 3.0}, guidance=1.0)) == (
        "guidance_scale_2"
    )
    assert refused(engine, video_req("y", guidance=1.0, negative_prompt="n")) == "negative_prompt"
    assert refused(engine, video_req("z", {"boundary_ratio": 1.5})) == "boundary_ratio"
    assert refused(engine, video_req("t", {"true_cfg_scale": 2.0})) == "true_cfg_scale"
    announced = {k.name for k in engine.adapter.applied_knobs()}
    assert announced == {"guidance_scale_2", "boundary_ratio", "flow_shift"}


def test_wan_guidance_scale_2_is_refused_where_no_step_reaches_the_low_noise_expert(wan):
    """diffusers' WanPipeline: transformer_2, guided by guidance_scale_2, runs the steps with
    timestep t < boundary_ratio * num_train_timesteps. The tiny model switches at 0.875: one
    step (t = 999) never gets there, nor does any step with boundary_ratio 0."""
    engine, _ = wan
    one_step = dataclasses.replace(video_req("s", {"guidance_scale_2": 3.0}), num_inference_steps=1)
    assert refused(engine, one_step) == "guidance_scale_2"
    zero = video_req("b0", {"guidance_scale_2": 3.0, "boundary_ratio": 0.0})
    assert refused(engine, zero) == "guidance_scale_2"
    engine.validate(video_req("ok", {"guidance_scale_2": 3.0}))  # STEPS steps reach it


def test_wan_boundary_without_a_second_expert_is_refused_at_load(wan):
    """A checkpoint whose model_index.json sets boundary_ratio without a transformer_2: the
    switch would call a missing expert, so the stage refuses to start, saying so."""
    from diffusers import WanPipeline

    from vllm_omni_plugin.diffusion.adapters.wan import WanAdapter
    from vllm_omni_plugin.diffusion.errors import UnsupportedModelError

    _, pipe = wan
    parts = {k: v for k, v in pipe.components.items() if k != "transformer_2"}
    lone = WanPipeline(**parts, transformer_2=None, boundary_ratio=0.875)
    with pytest.raises(UnsupportedModelError, match="no transformer_2"):
        WanAdapter(lone, torch.device("cpu"), torch.float32, {})


def test_each_adapter_declares_its_family_knobs_from_the_table():
    """The API server's table of families (common/knobs.py) is what the adapters apply."""
    from vllm_omni_plugin.common.knobs import FAMILY_KNOBS
    from vllm_omni_plugin.diffusion.adapters import get_adapter_class

    for pipeline_class in (
        "QwenImagePipeline",
        "QwenImageEditPipeline",
        "QwenImageEditPlusPipeline",
        "FluxPipeline",
        "FluxKontextPipeline",
        "WanPipeline",
        "WanImageToVideoPipeline",
        "GlmImagePipeline",
        "ZImagePipeline",
        "Flux2KleinPipeline",
    ):
        adapter = get_adapter_class(pipeline_class)
        assert adapter.knobs == FAMILY_KNOBS[adapter.family], pipeline_class
