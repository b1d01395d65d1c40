"""The full-size random Wan2.2 builders: published sizes (parameter counts on the meta device),
and a one-layer TI2V-5B build at full width through the CLI that diffusers' WanPipeline loads
with no missing or unexpected keys and runs to video frames."""

from __future__ import annotations

import gc
import json

import numpy as np
import pytest
import torch

from vllm_omni_plugin.testing import full_wan


def _meta_params(factory) -> float:
    with torch.device("meta"):
        module = factory()
    return sum(p.numel() for p in module.parameters()) / 1e9


def test_ti2v_5b_full_sizes_are_the_published_ones():
    """TI2V-5B: transformer 5.00B (the published "5B", within 0.5%: 4.9998B counted), UMT5-XXL
    encoder 5.68B (the hub's 11.4 GB of bf16), Wan2.2 VAE 0.705B (its 2.8 GB of fp32)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    c = full_wan.full_configs()
    dit = _meta_params(lambda: WanTransformer3DModel(**c["transformer"]))
    te = _meta_params(lambda: UMT5EncoderModel(c["text_encoder"]))
    vae = _meta_params(lambda: AutoencoderKLWan(**c["vae"]))
    assert abs(dit - 5.0) / 5.0 < 0.005, dit
    assert (round(dit, 3), round(te, 2), round(vae, 3)) == (5.000, 5.68, 0.705)
    # The transformer reads UMT5's hidden states and the VAE's 48 latent channels.
    assert c["transformer"]["text_dim"] == c["text_encoder"].d_model
    assert c["transformer"]["in_channels"] == c["vae"]["z_dim"] == len(c["vae"]["latents_std"])


def test_t2v_a14b_full_sizes_are_the_published_ones():
    """T2V-A14B: each expert 14.29B (the published "A14B": 14B active per step), Wan2.1 VAE
    0.127B."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    c = full_wan.full_configs(variant="t2v-a14b")
    dit = _meta_params(lambda: WanTransformer3DModel(**c["transformer"]))
    vae = _meta_params(lambda: AutoencoderKLWan(**c["vae"]))
    assert (round(dit, 2), round(vae, 3)) == (14.29, 0.127)
    assert c["transformer"]["in_channels"] == AutoencoderKLWan().config.z_dim == 16


def test_dit_floor_uses_the_builders_wan_configs():
    """benchmarks/dit_floor_families.py repeats the transformer configs (it imports nothing of
    the plugin at load time): they must stay the builder's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import dit_floor_families as floor

    for theirs, ours in (
        (floor.WAN_TI2V_5B, full_wan.TI2V_DIT),
        (floor.WAN_A14B, full_wan.A14B_DIT),
    ):
        assert {k: v for k, v in theirs.items() if k != "rope_max_seq_len"} == ours


def test_num_layers_cuts_depth_only():
    c = full_wan.full_configs(num_layers=2)
    assert c["transformer"]["num_layers"] == c["text_encoder"].num_layers == 2
    assert c["transformer"]["ffn_dim"] == 14336 and c["text_encoder"].d_model == 4096
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        full_wan.full_configs(0)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """`vllm-omni-plugin make-tiny-model ARGS` through the console script's `main`, in this
    process (test_full_qwen_flux says why)."""
    from vllm_omni_plugin.cli import main

    capsys.readouterr()
    with torch.random.fork_rng():  # the builder seeds the global generator
        code = main(["make-tiny-model", *args])
    gc.collect()
    out, err = capsys.readouterr()
    return code, out, err


def _no_missing_keys(cls, path, **kw):
    model, info = cls.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True, **kw)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model


@pytest.mark.slow
def test_reduced_depth_ti2v_full_build_runs_in_diffusers(ram_dir, capsys):
    """One layer per stack at the published full width (UMT5's 1.05B-entry embedding and the
    whole 0.7B VAE included), written by the CLI and run by diffusers: a 64x64, 5-frame video in
    2 steps. About 30 s alone: initialising, writing and reading back UMT5's 1.05B-entry
    embedding table (2.1 GB in bf16) and the VAE."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    out = ram_dir / "wan-ti2v-full-1"
    code, stdout, stderr = _cli(capsys, "wan-ti2v", str(out), "--size", "full", "--num-layers", "1")
    assert code == 0, stderr[-3000:]
    assert "Wan2.2 TI2V-5B full size (1 layers per stack)" in stdout
    index = json.loads((out / "model_index.json").read_text())
    assert (index["_class_name"], index["expand_timesteps"]) == ("WanPipeline", True)
    te = _no_missing_keys(UMT5EncoderModel, out / "text_encoder")
    assert (te.config.d_model, te.config.vocab_size) == (4096, 256384)
    dit = _no_missing_keys(WanTransformer3DModel, out / "transformer")
    assert dit.config.in_channels == 48 and dit.config.num_layers == 1
    # The VAE decodes in float32 (an exact upcast of its bf16 weights): this CPU has no fast
    # bf16 convolution (test_full_glm_image).
    vae = _no_missing_keys(AutoencoderKLWan, out / "vae").to(torch.float32)
    assert vae.config.z_dim == 48 and vae.config.scale_factor_spatial == 16
    pipe = WanPipeline.from_pretrained(
        out, text_encoder=te, transformer=dit, vae=vae, dtype=torch.bfloat16
    )
    assert pipe.config.expand_timesteps and pipe.transformer_2 is None
    pipe.set_progress_bar_config(disable=True)
    decode = pipe.vae.decode
    pipe.vae.decode = lambda z, *a, **kw: decode(z.to(torch.float32), *a, **kw)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared 2-core box
    try:
        frames = pipe(
            prompt="a red cube",
            height=64,
            width=64,
            num_frames=5,
            num_inference_steps=2,
            guidance_scale=1.0,  # no CFG: one transformer pass per step
            max_sequence_length=16,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).frames[0]
    finally:
        torch.set_num_threads(before)
    assert frames.shape == (5, 64, 64, 3)
    assert np.isfinite(frames).all() and frames.std() > 0
