"""LoRA on Wan2.2's two experts, against diffusers' WanPipeline after `load_lora_weights(folder)`
(into `transformer`, the high-noise expert) + `load_lora_weights(folder / "transformer_2",
load_into_transformer_2=True)` (the low-noise expert) + `set_adapters([name], [scale])`, on the
same tiny checkpoint, adapters and seed.

Two steps on the tiny Wan2.2 text-to-video (boundary_ratio 0.875: timesteps 999 on the
high-noise expert, 750 on the low-noise one) and image-to-video (I2V-A14B, 0.9: 999 and 833), so
every request crosses the expert switch. One mixed batch: a row with an
adapter for both experts, a row with a low-noise-only adapter (negative scale), a plain row, each
with its CFG row; every forward shares all rows.

Tolerance: mean absolute difference <= 0.5 on the 0-255 scale over every frame, and each video
far closer to diffusers' adapted video than the plain video is (each expert's adapter must
show). Bad second-expert files are refused naming `lora` and the expert, nothing loaded.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.errors import RequestValidationError
from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora

SIZE = 32
FRAMES = 5


def build_adapters(model_dir, root):
    build_tiny_lora(model_dir, root / "both", rank=4, seed=3)
    # A low-noise-only adapter: only its transformer_2/ file.
    build_tiny_lora(model_dir, root / "low", rank=4, seed=4)
    (root / "low" / "pytorch_lora_weights.safetensors").unlink()
    return root


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("wan")


@pytest.fixture(scope="module")
def lora_dir(model_dir, tmp_path_factory):
    return build_adapters(model_dir, tmp_path_factory.mktemp("wan-loras"))


@pytest.fixture(scope="module")
def engine(model_dir, lora_dir, one_torch_thread):
    return make_engine(model_dir, lora_dir)


def make_engine(model_dir, lora_dir) -> DiffusionEngine:
    cfg = DiffusionEngineConfig(model=str(model_dir), max_batch_size=4, lora={"dir": str(lora_dir)})
    return DiffusionEngine(cfg)


def source() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))


def request(rid: str, seed: int, lora=None, image: bool = False) -> GenerationRequest:
    return GenerationRequest(
        rid,
        f"prompt {seed}",
        negative_prompt="blurry",
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        guidance_scale=4.0,
        seed=seed,
        lora=lora,
        num_frames=FRAMES,
        input_images=[source()] if image else [],
    )


def frames(images) -> np.ndarray:
    return np.stack([np.asarray(i.convert("RGB"), dtype=np.float64) for i in images])


def _embeds(pipe, text: str) -> torch.Tensor:
    from diffusers import WanPipeline

    return WanPipeline._get_t5_prompt_embeds(
        pipe, [text], max_sequence_length=512, device=torch.device("cpu")
    )


def reference(model_dir, lora_dir, r: GenerationRequest) -> np.ndarray:
    import diffusers

    cls = diffusers.WanImageToVideoPipeline if r.input_images else diffusers.WanPipeline
    pipe = cls.from_pretrained(str(model_dir))
    pipe.set_progress_bar_config(disable=True)
    (item,) = r.lora
    folder = lora_dir / item["name"]
    if (folder / "pytorch_lora_weights.safetensors").exists():
        pipe.load_lora_weights(str(folder), adapter_name=item["name"])
    pipe.load_lora_weights(
        str(folder / "transformer_2"), adapter_name=item["name"], load_into_transformer_2=True
    )
    pipe.set_adapters([item["name"]], [item["scale"]])
    common = dict(
        height=SIZE,
        width=SIZE,
        num_frames=FRAMES,
        num_inference_steps=2,
        guidance_scale=r.guidance_scale,
        generator=torch.Generator("cpu").manual_seed(r.seed),
        output_type="pil",
    )
    if not r.input_images:
        return frames(pipe(r.prompt, negative_prompt=r.negative_prompt, **common).frames[0])
    # WanImageToVideoPipeline cleans prompts with ftfy unchecked: embeddings as the engine's.
    out = pipe(
        image=r.input_images[0],
        prompt_embeds=_embeds(pipe, r.prompt),
        negative_prompt_embeds=_embeds(pipe, r.negative_prompt),
        **common,
    )
    return frames(out.frames[0])


def check_mixed_batch(engine, model_dir, lora_dir, image: bool) -> None:
    timesteps = engine.adapter._timesteps(2)
    assert timesteps[0] >= engine.adapter.boundary > timesteps[1]  # one step on each expert
    both = request("both", 1, [{"name": "both", "scale": 0.9}], image)
    low = request("low", 1, [{"name": "low", "scale": -1.2}], image)
    plain = request("plain", 1, image=image)
    outs = engine.generate([both, low, plain])
    assert all(o.error is None and o.metrics["max_batch"] == 3 for o in outs)  # shared forwards
    got_both, got_low, got_plain = (frames(o.images) for o in outs)
    for got, r in ((got_both, both), (got_low, low)):
        ref = reference(model_dir, lora_dir, r)
        diff = np.abs(got - ref).mean()
        assert diff <= 0.5, (r.request_id, diff)
        assert np.abs(got_plain - ref).mean() > 4 * max(diff, 0.1), r.request_id
    # The high-noise file alone would not give diffusers' video: the second expert's counts.
    assert np.abs(got_both - got_low).mean() > 2


def test_mixed_batch_across_the_expert_switch_equals_diffusers(engine, model_dir, lora_dir):
    check_mixed_batch(engine, model_dir, lora_dir, image=False)


def test_image_to_video_two_experts_equal_diffusers(tiny_models, tmp_path, one_torch_thread):
    """Wan2.2 I2V-A14B (WanImageToVideoPipeline, two experts): the same rule, every row with
    its source image."""
    model = tiny_models("wan-i2v")
    lora_dir = build_adapters(model, tmp_path)
    check_mixed_batch(make_engine(model, lora_dir), model, lora_dir, image=True)


def test_second_expert_files_are_checked(engine, model_dir, lora_dir, tiny_models, tmp_path):
    # An adapter of another family under transformer_2/, and a folder with neither file.
    other = lora_dir / "wrong-second"
    build_tiny_lora(model_dir, other, rank=4, seed=5)
    shutil.rmtree(other / "transformer_2")
    build_tiny_lora(tiny_models("flux"), other / "transformer_2", rank=4, seed=5)
    (lora_dir / "empty" / "transformer_2").mkdir(parents=True)
    loads = engine.lora.loads
    for name, message in (
        ("wrong-second", "adapter 'wrong-second' (transformer_2) does not fit Wan2.2"),
        ("empty", "or transformer_2/pytorch_lora_weights.safetensors"),
    ):
        with pytest.raises(RequestValidationError) as info:
            engine.add_request(request("bad", 1, [{"name": name}]))
        assert info.value.field == "lora" and message in info.value.message
        assert engine.scheduler.find("bad") is None
    assert engine.lora.loads == loads
    assert "targets_2" in engine.lora.facts()  # the API server checks transformer_2/ too


def test_second_expert_folder_is_refused_where_there_is_one_transformer(tiny_models, tmp_path):
    """FLUX has one transformer: an adapter holding transformer_2/ is refused, not ignored."""
    from vllm_omni_plugin.common.lora_files import LoraError, read_adapter
    from vllm_omni_plugin.diffusion.lora.tiny import lora_targets

    _, targets = lora_targets(tiny_models("flux"))
    build_tiny_lora(tiny_models("flux"), tmp_path / "a" / "transformer_2", rank=2, seed=1)
    build_tiny_lora(tiny_models("flux"), tmp_path / "a", rank=2, seed=1)
    with pytest.raises(LoraError, match="holds transformer_2/ .*FLUX here has one transformer"):
        read_adapter(tmp_path / "a", targets["transformer"], 8, "FLUX")
