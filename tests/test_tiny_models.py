"""The tiny checkpoints load and run in diffusers' own pipelines, and are seed-deterministic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm_omni_plugin.testing import tiny_glm_image as glm
from vllm_omni_plugin.testing.tiny_models import KINDS, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: per-op overhead

PIPELINE_CLASS = {
    "glm-image": "GlmImagePipeline",
    "qwen-image": "QwenImagePipeline",
    "flux": "FluxPipeline",
    "z-image": "ZImagePipeline",
    "flux2-klein": "Flux2KleinPipeline",
}
# Families whose builder is checked by their own family test instead of the text-to-image runs
# below: qwen-image-edit needs a source image (and ~15 s per CPU run at its 1 MP condition
# area), so tests/diffusion/test_qwen_image_edit.py runs it in diffusers' QwenImageEditPipeline.
# flux-kontext and qwen-image-edit-plus edit source images (Kontext also sizes its output to
# a 1 MP area): tests/diffusion/test_flux_kontext.py and test_qwen_image_edit_plus.py run them in
# diffusers' FluxKontextPipeline and QwenImageEditPlusPipeline.
# wan makes videos (WanPipeline returns frames, not images): tests/diffusion/test_wan.py runs it,
# and tests/diffusion/test_wan_i2v.py runs wan-ti2v and wan-i2v.
# qwen3-omni is a transformers model (text and speech): tests/qwen3_omni/ runs it.
OWN_TESTS = (
    "qwen-image-edit",
    "flux-kontext",
    "qwen-image-edit-plus",
    "wan",
    "wan-ti2v",
    "wan-i2v",
    "qwen3-omni",
)
TEXT_TO_IMAGE_KINDS = tuple(k for k in KINDS if k not in OWN_TESTS)


def _load(path: Path):
    import diffusers

    return diffusers.DiffusionPipeline.from_pretrained(path)


def _weights(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.safetensors"))}


def _generate(pipe, seed: int) -> np.ndarray:
    out = pipe(
        prompt="a red cube",
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed),
    )
    image = out.images[0]
    assert image.size == (64, 64)
    return np.asarray(image)


@pytest.fixture(scope="module")
def glm_pipe(tiny_models):
    from diffusers import GlmImagePipeline

    return GlmImagePipeline.from_pretrained(tiny_models("glm-image"))


@pytest.mark.parametrize("kind", TEXT_TO_IMAGE_KINDS)
def test_runs_in_diffusers_pipeline(tiny_models, kind):
    path = tiny_models(kind)
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == PIPELINE_CLASS[kind]
    pipe = _load(path)
    assert type(pipe).__name__ == PIPELINE_CLASS[kind]
    first = _generate(pipe, seed=0)
    assert first.shape == (64, 64, 3)
    assert first.std() > 0, "a constant image means a component is degenerate"
    # diffusers' pipeline is deterministic from its generator on these weights.
    np.testing.assert_array_equal(first, _generate(pipe, seed=0))


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_from_seed(tiny_models, tmp_path, kind):
    reference = _weights(tiny_models(kind))
    assert reference, "no weight files written"
    assert _weights(build_tiny_model(kind, tmp_path / "same", seed=0)) == reference
    other = _weights(build_tiny_model(kind, tmp_path / "other", seed=1))
    assert other.keys() == reference.keys()
    assert all(other[name] != reference[name] for name in reference)


@pytest.mark.parametrize("kind", ["qwen-image", "wan"])
def test_cli_writes_the_same_checkpoint(tiny_models, tmp_path, kind):
    cli = Path(sys.executable).with_name("vllm-omni-plugin")
    out = tmp_path / f"cli-{kind}"
    done = subprocess.run(
        [str(cli), "make-tiny-model", kind, str(out), "--seed", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert str(out) in done.stdout
    assert _weights(out) == _weights(tiny_models(kind))


def test_the_console_script_takes_every_kind_the_builders_know():
    """One table: the console script's kinds are the builders' kinds, no more, no fewer."""
    from vllm_omni_plugin.cli import build_parser

    parser = build_parser()
    for kind in KINDS:
        assert parser.parse_args(["make-tiny-model", kind, "/unused"]).kind == kind
    tiny = next(
        a
        for a in parser._subparsers._group_actions[0].choices["make-tiny-model"]._actions
        if a.dest == "kind"
    )
    assert tuple(tiny.choices) == KINDS
    with pytest.raises(SystemExit):
        parser.parse_args(["make-tiny-model", "sd3", "/unused"])


def test_unknown_kind_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny model kind"):
        build_tiny_model("sd3", tmp_path)


def test_glm_image_couplings(glm_pipe):
    ar = glm_pipe.vision_language_encoder.config
    text = ar.text_config
    rope = text.rope_parameters
    assert text.head_dim >= 32  # vLLM's CPU attention
    assert sum(rope["mrope_section"]) == text.head_dim * rope["partial_rotary_factor"] / 2
    assert glm_pipe.vision_language_encoder.lm_head.out_features == text.vision_vocab_size
    dit = glm_pipe.transformer.config
    assert dit.prior_vq_quantizer_codebook_size >= text.vision_vocab_size
    assert dit.text_embed_dim == glm_pipe.text_encoder.config.d_model
    assert dit.attention_head_dim % 4 == 0
    assert glm_pipe.vae_scale_factor * dit.patch_size == 16
    assert len(glm_pipe.vae.config.latents_mean) == glm_pipe.vae.config.latent_channels
    assert glm_pipe.scheduler.config.use_dynamic_shifting
    assert ar.vq_config.latent_channels == ar.vision_config.hidden_size


def test_glm_image_processor_layout(glm_pipe):
    processor = glm_pipe.processor
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids(processor.bos_token) == glm.IMAGE_START_ID
    assert processor.image_token_id == glm.IMAGE_TOKEN_ID
    assert tok.convert_tokens_to_ids(processor.grid_bos_token) == glm.GRID_BOS_ID
    assert tok.convert_tokens_to_ids(processor.grid_eos_token) == glm.GRID_EOS_ID
    assert tok.pad_token_id == glm.PAD_ID
    inputs = processor.apply_chat_template(
        [[{"role": "user", "content": [{"type": "text", "text": "a red cube"}]}]],
        tokenize=True,
        target_h=64,
        target_w=64,
        return_dict=True,
        return_tensors="pt",
    )
    ids = inputs["input_ids"][0].tolist()
    expected_text = "a red cube<sop>2 2<eop><sop>16 16<eop>"
    assert tok.decode(ids[:-1]) == expected_text
    assert ids[-1] == glm.IMAGE_START_ID
    assert all(i >= glm.TEXT_OFFSET for i in ids[:-1])  # text never collides with vision ids
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 16, 16]]


def test_glm_image_ar_writes_grid_codes_then_eos(glm_pipe):
    """Like the trained model: exactly preview + large grid codes, then EOS (needs the generation
    config's bias + forced EOS, since random weights would otherwise stop early)."""
    inputs = glm_pipe.processor.apply_chat_template(
        [[{"role": "user", "content": [{"type": "text", "text": "a red cube"}]}]],
        tokenize=True,
        target_h=64,
        target_w=64,
        return_dict=True,
        return_tensors="pt",
    )
    torch.manual_seed(0)
    out = glm_pipe.vision_language_encoder.generate(**inputs, max_new_tokens=16 * 16 + 4 + 1)
    generated = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(generated) == 261
    assert generated[-1] == glm.IMAGE_END_ID
    assert all(0 <= t < glm.NUM_IMAGE_CODES for t in generated[:-1])
    # diffusers keeps the last 2x2 grid, upsampled 2x to the DiT's 4x4 patch grid.
    prior, _, _ = glm_pipe.generate_prior_tokens(
        "a red cube", 64, 64, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0)
    )
    large = torch.tensor(generated[256:260]).view(1, 1, 2, 2).float()
    upsampled = torch.nn.functional.interpolate(large, scale_factor=2, mode="nearest").long()
    assert prior.tolist() == upsampled.view(1, -1).tolist()


def test_qwen_image_template_prefix_matches_drop_idx(tiny_models):
    pipe = _load(tiny_models("qwen-image"))
    prefix = pipe.prompt_template_encode.split("{}")[0]
    # The pipeline drops this many leading hidden states; with the real tokenizer that is exactly
    # the system-prompt prefix, and so it must be with the tiny one.
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    assert pipe.tokenizer.convert_tokens_to_ids("<|image_pad|>") == (
        pipe.text_encoder.config.image_token_id
    )
