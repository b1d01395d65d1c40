"""The full-size random Qwen-Image and FLUX.1-dev builders: published sizes (parameter counts on
the meta device), and a one-layer-per-stack build at full width through the CLI that diffusers
loads with no missing or unexpected keys and runs to an image."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import torch

from vllm_omni_plugin.testing import full_flux, full_qwen_image


def _meta_params(factory) -> float:
    with torch.device("meta"):
        module = factory()
    return sum(p.numel() for p in module.parameters()) / 1e9


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """`vllm-omni-plugin make-tiny-model ARGS` through the console script's `main`, in this
    process: the test imports torch, diffusers and transformers anyway, and a fresh process
    would import them again (~6 CPU-seconds). test_full_glm_image runs the installed script."""
    from vllm_omni_plugin.cli import main

    capsys.readouterr()
    with torch.random.fork_rng():  # the builder seeds the global generator
        code = main(["make-tiny-model", *args])
    gc.collect()  # the build's modules, before the test loads the files back
    out, err = capsys.readouterr()
    return code, out, err


def test_qwen_image_full_sizes_are_the_published_ones():
    """Qwen2.5-VL-7B text encoder 8.29B, MMDiT 20.43B (the published 20B), VAE 0.127B."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    c = full_qwen_image.full_configs()
    te = _meta_params(lambda: Qwen2_5_VLForConditionalGeneration(c["text_encoder"]))
    dit = _meta_params(lambda: QwenImageTransformer2DModel(**c["transformer"]))
    vae = _meta_params(lambda: AutoencoderKLQwenImage())
    assert (round(te, 2), round(dit, 2), round(vae, 3)) == (8.29, 20.43, 0.127)
    # The DiT reads the text encoder's hidden states: the two widths must agree.
    assert c["transformer"]["joint_attention_dim"] == c["text_encoder"].text_config.hidden_size
    assert c["text_encoder"].image_token_id == 151655


def test_flux_full_sizes_are_the_published_ones():
    """FLUX.1-dev transformer 11.90B, T5-XXL encoder 4.76B, CLIP-L text 0.123B, VAE 0.084B."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    c = full_flux.full_configs()
    counts = (
        _meta_params(lambda: FluxTransformer2DModel(**c["transformer"])),
        _meta_params(lambda: T5EncoderModel(c["text_encoder_2"])),
        _meta_params(lambda: CLIPTextModel(c["text_encoder"])),
        _meta_params(lambda: AutoencoderKL(**c["vae"])),
    )
    assert tuple(round(x, 3) for x in counts) == (11.901, 4.762, 0.123, 0.084)
    assert c["transformer"]["joint_attention_dim"] == c["text_encoder_2"].d_model
    assert c["transformer"]["pooled_projection_dim"] == c["text_encoder"].projection_dim


def test_num_layers_must_be_positive():
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        full_qwen_image.full_configs(0)


def _generate(pipe) -> np.ndarray:
    # The VAE decodes in float32 (an exact upcast of its bf16 weights): this CPU has no fast
    # bf16 convolution (test_full_glm_image). FluxPipeline hands it bf16 latents: cast them.
    pipe.vae.to(torch.float32)
    decode = pipe.vae.decode
    pipe.vae.decode = lambda z, *a, **kw: decode(z.to(torch.float32), *a, **kw)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core box
    try:
        image = pipe(
            prompt="a red cube",
            height=64,
            width=64,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
        ).images[0]
    finally:
        torch.set_num_threads(before)
    return np.asarray(image)


def _no_missing_keys(cls, path, **kw):
    model, info = cls.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True, **kw)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model


def test_reduced_depth_qwen_image_full_build_runs_in_diffusers(ram_dir, capsys):
    """About 20 s alone on the 2-core machine, most of it the random init of the text
    encoder's full-width embeddings: one layer per stack at the published full width, written by
    the CLI and run by diffusers."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    out = ram_dir / "qwen-full-1"
    code, stdout, stderr = _cli(
        capsys, "qwen-image", str(out), "--size", "full", "--num-layers", "1"
    )
    assert code == 0, stderr[-3000:]
    assert "Qwen-Image full size (1 layers per stack)" in stdout
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    te = _no_missing_keys(Qwen2_5_VLForConditionalGeneration, out / "text_encoder")
    assert te.config.text_config.hidden_size == 3584
    dit = _no_missing_keys(QwenImageTransformer2DModel, out / "transformer")
    pipe = QwenImagePipeline.from_pretrained(
        out, text_encoder=te, transformer=dit, dtype=torch.bfloat16
    )
    pixels = _generate(pipe)
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0


def test_reduced_depth_flux_full_build_runs_in_diffusers(ram_dir, capsys):
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from transformers import T5EncoderModel

    out = ram_dir / "flux-full-1"
    code, stdout, stderr = _cli(capsys, "flux", str(out), "--size", "full", "--num-layers", "1")
    assert code == 0, stderr[-3000:]
    assert "FLUX.1-dev full size (1 layers per stack)" in stdout
    t5 = _no_missing_keys(T5EncoderModel, out / "text_encoder_2")
    assert t5.config.d_model == 4096
    dit = _no_missing_keys(FluxTransformer2DModel, out / "transformer")
    pipe = FluxPipeline.from_pretrained(
        out, text_encoder_2=t5, transformer=dit, dtype=torch.bfloat16
    )
    pixels = _generate(pipe)
    assert pixels.shape == (64, 64, 3) and pixels.std() > 0
