"""LoRA on the other families that declare LoRA targets (Qwen-Image, Qwen-Image-Edit, Wan2.2,
FLUX.2 klein, Z-Image; Wan2.2's two experts in test_lora_wan.py):
one mixed batch (a row with an adapter and its scale, a plain row, CFG rows) against diffusers'
pipeline after `load_lora_weights` + `set_adapters` on the same tiny checkpoint and seed.

Tolerance: mean absolute difference <= 0.5 on the 0-255 scale and
each image far closer to diffusers' adapted image than the plain image is (the adapter must
show). Qwen-Image-Edit conditions at a 64x64-pixel area on both sides for CPU time (as in
test_qwen_image_edit.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.adapters.loader import load_pipeline
from vllm_omni_plugin.diffusion.adapters.qwen_image_edit import QwenImageEditAdapter
from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

AREA = 64 * 64
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead


class SmallConditionAdapter(QwenImageEditAdapter):
    condition_pixels = AREA


def source() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))


def frames(images) -> np.ndarray:
    return np.stack([np.asarray(i.convert("RGB"), dtype=np.float64) for i in images])


def engine_for(kind: str, folder, lora_dir) -> DiffusionEngine:
    sizes = {"min_height": 32, "min_width": 32} if kind == "z-image" else {}
    cfg = DiffusionEngineConfig(
        model=str(folder), max_batch_size=4, lora={"dir": str(lora_dir)}, **sizes
    )
    if kind != "qwen-image-edit":
        return DiffusionEngine(cfg)
    cpu = torch.device("cpu")
    pipe = load_pipeline(folder, torch.float32, cpu, skip=QwenImageEditAdapter.skip_components)
    return DiffusionEngine(cfg, SmallConditionAdapter(pipe, cpu, torch.float32, {}))


def request(kind: str, rid: str, seed: int, lora=None) -> GenerationRequest:
    extra = {}
    if kind == "qwen-image-edit":
        extra["input_images"] = [source()]
    size = 32 if kind in ("flux2-klein", "z-image") else 64
    # Qwen-Image's CFG scale is true_cfg_scale (its guidance_scale is refused unless distilled).
    qwen = kind.startswith("qwen")
    return GenerationRequest(
        rid,
        f"prompt {seed}",
        # FLUX.2 klein's CFG runs against the empty prompt (it takes no negative prompt);
        # Z-Image-Turbo runs without CFG.
        negative_prompt=None if kind in ("flux2-klein", "z-image") else "blurry",
        height=size,
        width=size,
        num_inference_steps=2,
        guidance_scale=None if qwen or kind == "z-image" else 4.0,
        knobs={"true_cfg_scale": 4.0} if qwen else {},
        seed=seed,
        lora=lora,
        **extra,
    )


def reference(kind: str, folder, lora_dir, r: GenerationRequest) -> np.ndarray:
    import diffusers

    gen = torch.Generator("cpu").manual_seed(r.seed)
    common = dict(
        negative_prompt=r.negative_prompt,
        height=r.height,
        width=r.width,
        num_inference_steps=r.num_inference_steps,
        generator=gen,
    )
    if kind in ("flux2-klein", "z-image"):
        common.pop("negative_prompt")
    if kind == "flux2-klein":
        pipe = diffusers.Flux2KleinPipeline.from_pretrained(str(folder))
    elif kind == "z-image":
        pipe = diffusers.ZImagePipeline.from_pretrained(str(folder))
    elif kind == "qwen-image":
        pipe = diffusers.QwenImagePipeline.from_pretrained(str(folder))
    else:
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as module

        from vllm_omni_plugin.diffusion.adapters.qwen_image_edit import load_processor

        pipe = diffusers.QwenImageEditPipeline.from_pretrained(
            str(folder), processor=load_processor(folder / "processor")
        )
    pipe.set_progress_bar_config(disable=True)
    if r.lora:
        pipe.load_lora_weights(str(lora_dir / "style"), adapter_name="style")
        pipe.set_adapters(["style"], [r.lora[0]["scale"]])
    if kind == "qwen-image":
        return frames(pipe(r.prompt, true_cfg_scale=4.0, **common).images)
    if kind == "flux2-klein":
        return frames(pipe(prompt=r.prompt, guidance_scale=r.guidance_scale, **common).images)
    if kind == "z-image":  # Turbo: guidance_scale=0 (no CFG), as the engine runs it
        return frames(pipe(r.prompt, guidance_scale=0.0, **common).images)
    original = module.calculate_dimensions
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "calculate_dimensions", lambda _area, ratio: original(AREA, ratio))
        out = pipe(r.input_images[0], r.prompt, true_cfg_scale=4.0, **common)
    return frames(out.images)


@pytest.mark.parametrize("kind", ["qwen-image", "qwen-image-edit", "flux2-klein", "z-image"])
def test_mixed_batch_equals_diffusers(kind, tiny_models, tmp_path):
    folder = tiny_models(kind)
    build_tiny_lora(folder, tmp_path / "style", rank=4, seed=3)
    engine = engine_for(kind, folder, tmp_path)
    styled = request(kind, "styled", 1, [{"name": "style", "scale": 0.9}])
    plain = request(kind, "plain", 1)
    outs = engine.generate([styled, plain])
    assert all(o.metrics["max_batch"] == 2 for o in outs)  # one forward for both rows
    got_styled, got_plain = frames(outs[0].images), frames(outs[1].images)
    ref = reference(kind, folder, tmp_path, styled)
    assert np.abs(got_styled - ref).mean() <= 0.5, kind
    assert np.abs(got_plain - ref).mean() > 4 * max(np.abs(got_styled - ref).mean(), 0.1), kind


def test_z_image_embedders_are_refused_not_ignored(tiny_models, tmp_path):
    """Z-Image's patch and caption embedders see every image's tokens in one row: an adapter
    for them is refused naming the module (diffusers would adapt them), nothing loaded."""
    from safetensors.torch import save_file

    from vllm_omni_plugin.diffusion.errors import RequestValidationError

    folder = tiny_models("z-image")
    engine = engine_for("z-image", folder, tmp_path)
    (tmp_path / "embed").mkdir()
    cap = engine.adapter.pipe.transformer.cap_embedder[1]
    save_file(
        {
            "transformer.cap_embedder.1.lora_A.weight": torch.zeros(2, cap.in_features),
            "transformer.cap_embedder.1.lora_B.weight": torch.zeros(cap.out_features, 2),
        },
        str(tmp_path / "embed" / "pytorch_lora_weights.safetensors"),
    )
    with pytest.raises(RequestValidationError, match="no target linear 'cap_embedder.1'"):
        engine.add_request(request("z-image", "e", 1, [{"name": "embed"}]))
    assert engine.lora.resident() == [] and engine.lora.loads == 0


def test_glm_image_takes_no_lora_naming_the_family(tiny_models, tmp_path):
    """diffusers 0.42 has no LoRA loader for GLM-Image (GlmImagePipeline mixes in none): a stage
    with `lora` refuses to start naming the family, and make-tiny-lora refuses it."""
    import diffusers

    from vllm_omni_plugin.diffusion.errors import DiffusionEngineError

    assert not hasattr(diffusers.GlmImagePipeline, "load_lora_weights")  # else: opt it in
    folder = tiny_models("glm-image")
    cfg = DiffusionEngineConfig(model=str(folder), lora={"dir": str(tmp_path)})
    with pytest.raises(DiffusionEngineError, match="lora: GLM-Image does not take LoRA adapters"):
        DiffusionEngine(cfg)
    with pytest.raises(ValueError, match="GlmImagePipeline takes no LoRA adapters"):
        build_tiny_lora(folder, tmp_path / "x")
