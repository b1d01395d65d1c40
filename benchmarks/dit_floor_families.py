"""The diffusion families whose step floor dit_floor.py measures: each family's transformer at
its published size, its served shape and guidance (read from its deploy file), and one
denoising step's transformer inputs at that shape.

Transformers are built under FakeTensorMode (dit_floor_ops.record_ops): no weights are made,
so the 12-20B models cost nothing to build here. Sizes:

- FLUX.1-dev, Qwen-Image, GLM-Image's DiT: the configs the full-size random builders write
  (`make-tiny-model ... --size full`, vllm_omni_plugin/testing/full_*.py).
- Wan2.2: the transformer configs of the full-size builder (vllm_omni_plugin/testing/full_wan.py,
  which says where they come from), repeated below (tests/test_full_wan.py keeps them equal) so
  that this module imports nothing of the plugin at load time. T2V-A14B's
  two experts (high- and low-noise) are one architecture, diffusers' WanTransformer3DModel
  defaults (40 layers, 40 heads x 128, FFN 13824, 16 channels); a step runs one of them.
  TI2V-5B: 30 layers, 24 heads x 128, FFN 14336, 48 channels, with its VAE's 16x spatial and
  4x temporal compression (A14B's VAE: 8x, 4x).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
STAGE_CONFIGS = REPO / "stage_configs"

WAN_A14B = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "num_layers": 40,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
WAN_TI2V_5B = {
    **WAN_A14B,
    "num_attention_heads": 24,
    "in_channels": 48,
    "out_channels": 48,
    "ffn_dim": 14336,
    "num_layers": 30,
}
WAN_TEXT_TOKENS = 512  # WanPipeline pads every prompt's UMT5 embeddings to 512 tokens
FLUX_TEXT_TOKENS = 512  # FluxPipeline's max_sequence_length: T5 embeddings padded to it
# Qwen-Image keeps only a prompt's own tokens (after its 34-token template); the served runs'
# prompts are a few words.
QWEN_TEXT_TOKENS = 16
GLM_GLYPH_TOKENS = 1  # a prompt without quoted text: one glyph token (dit_sections.glm_section)


@dataclasses.dataclass(frozen=True)
class Shape:
    height: int
    width: int
    steps: int
    guidance: float
    frames: int | None = None  # videos only
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's floor: its transformer, served shape and the CFG rows of a step."""

    name: str
    title: str
    stage_config: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.nn.Module, Shape, int], dict]
    cfg_rows: Callable[[Shape], int]
    # The frames a video family is served with when its deploy file sets none.
    frames: int | None = None
    frames_why: str = ""
    # Served step goal (ms per step, lossless, CFG rows included), where one is set.
    step_goal_ms: float | None = None

    def shape(self) -> Shape:
        return served_shape(self)

    def blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        from vllm_omni_plugin.diffusion.acceleration import _repeated_blocks

        return list(_repeated_blocks(model))


def served_shape(family: Family) -> Shape:
    """Height, width, steps and guidance of the family's deploy file's diffusion stage."""
    path = STAGE_CONFIGS / family.stage_config
    doc = yaml.safe_load(path.read_text())
    stage = next(
        s for s in reversed(doc["stages"]) if "height" in (s.get("default_sampling_params") or {})
    )
    p = stage["default_sampling_params"]
    guidance = p.get("guidance_scale", p.get("true_cfg_scale", 0.0))
    frames = p.get("num_frames", family.frames)
    source = f"stage_configs/{family.stage_config}"
    if frames is not None and "num_frames" not in p:
        source += f"; {frames} frames: {family.frames_why}"
    return Shape(
        int(p["height"]),
        int(p["width"]),
        int(p["num_inference_steps"]),
        float(guidance),
        frames,
        source,
    )


def fake_build(cls, config: dict) -> torch.nn.Module:
    """`cls(**config)` in bf16, for use under FakeTensorMode."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return cls(**config).eval()
    finally:
        torch.set_default_dtype(prev)


def _rnd(*shape) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


# ---- FLUX.1-dev ------------------------------------------------------------------------------
def _flux_build():
    from diffusers import FluxTransformer2DModel

    from vllm_omni_plugin.testing.full_flux import DIT

    return fake_build(FluxTransformer2DModel, DIT)


def _flux_inputs(tr, shape: Shape, rows: int) -> dict:
    from diffusers import FluxPipeline

    cfg = tr.config
    h, w = shape.height // 16, shape.width // 16  # VAE 8x, then 2x2 packing
    t = FLUX_TEXT_TOKENS
    return dict(
        hidden_states=_rnd(rows, h * w, cfg.in_channels),
        timestep=_rnd(rows),
        guidance=torch.zeros(rows),
        pooled_projections=_rnd(rows, cfg.pooled_projection_dim),
        encoder_hidden_states=_rnd(rows, t, cfg.joint_attention_dim),
        txt_ids=torch.zeros(t, 3, dtype=torch.bfloat16),
        img_ids=FluxPipeline._prepare_latent_image_ids(rows, h, w, "cpu", torch.bfloat16),
        return_dict=False,
    )


# ---- Qwen-Image --------------------------------------------------------------------------------
def _qwen_build():
    from diffusers import QwenImageTransformer2DModel

    from vllm_omni_plugin.testing.full_qwen_image import DIT

    return fake_build(QwenImageTransformer2DModel, DIT)


def _qwen_inputs(tr, shape: Shape, rows: int) -> dict:
    cfg = tr.config
    h, w = shape.height // 16, shape.width // 16
    t = QWEN_TEXT_TOKENS
    return dict(
        hidden_states=_rnd(rows, h * w, cfg.in_channels),
        encoder_hidden_states=_rnd(rows, t, cfg.joint_attention_dim),
        encoder_hidden_states_mask=torch.ones(rows, t, dtype=torch.long),
        timestep=_rnd(rows),
        img_shapes=[[(1, h, w)]] * rows,
        return_dict=False,
    )


# ---- GLM-Image's DiT ---------------------------------------------------------------------------
def _glm_build():
    from diffusers import GlmImageTransformer2DModel

    from vllm_omni_plugin.testing.full_glm_image import DIT

    return fake_build(GlmImageTransformer2DModel, DIT)


def _glm_inputs(tr, shape: Shape, rows: int) -> dict:
    cfg = tr.config
    lh, lw = shape.height // 8, shape.width // 8
    tokens = (lh // cfg.patch_size) * (lw // cfg.patch_size)
    return dict(
        hidden_states=_rnd(rows, cfg.in_channels, lh, lw),
        encoder_hidden_states=_rnd(rows, GLM_GLYPH_TOKENS, cfg.text_embed_dim),
        prior_token_id=torch.zeros(rows, tokens, dtype=torch.long),
        # CFG's second row drops the prior image tokens
        prior_token_drop=torch.tensor([[i % 2 == 1] * tokens for i in range(rows)]),
        timestep=_rnd(rows),
        target_size=_rnd(rows, 2),
        crop_coords=_rnd(rows, 2),
        return_dict=False,
    )


# ---- Wan2.2 ------------------------------------------------------------------------------------
def _wan_build(config: dict):
    def build():
        from diffusers import WanTransformer3DModel

        return fake_build(WanTransformer3DModel, config)

    return build


def _wan_inputs(spatial: int, temporal: int, per_token_timesteps: bool):
    def inputs(tr, shape: Shape, rows: int) -> dict:
        cfg = tr.config
        f = (shape.frames - 1) // temporal + 1
        h, w = shape.height // spatial, shape.width // spatial
        latents = _rnd(rows, cfg.in_channels, f, h, w)
        pt, ph, pw = cfg.patch_size
        tokens = (f // pt) * (h // ph) * (w // pw)
        # TI2V (expand_timesteps): one timestep per latent token, so a source image can be the
        # first frame (its tokens at t=0); the time embedding then runs per token.
        timestep = _rnd(rows, tokens) if per_token_timesteps else _rnd(rows)
        return dict(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=_rnd(rows, WAN_TEXT_TOKENS, cfg.text_dim),
            return_dict=False,
        )

    return inputs


def _cfg_if_guided(shape: Shape) -> int:
    return 2 if shape.guidance > 1.0 else 1


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "flux",
            "FLUX.1-dev",
            "flux.yaml",
            _flux_build,
            _flux_inputs,
            lambda shape: 1,  # guidance is embedded: one forward per step
            step_goal_ms=120.0,
        ),
        Family(
            "qwen-image",
            "Qwen-Image",
            "qwen_image.yaml",
            _qwen_build,
            _qwen_inputs,
            # true CFG only when a request sends a negative_prompt; the served runs send none
            lambda shape: 1,
        ),
        Family(
            "glm-image",
            "GLM-Image DiT",
            "glm_image.yaml",
            _glm_build,
            _glm_inputs,
            _cfg_if_guided,  # both rows in one forward (equal glyph lengths)
            step_goal_ms=110.0,
        ),
        Family(
            "wan2.2-ti2v-5b",
            "Wan2.2 TI2V-5B",
            "wan2_2_ti2v.yaml",
            _wan_build(WAN_TI2V_5B),
            _wan_inputs(16, 4, per_token_timesteps=True),
            _cfg_if_guided,  # cond and uncond rows in one forward
            frames=121,
            frames_why="the model card's (the deploy file sets none)",
        ),
        Family(
            "wan2.2-t2v-a14b",
            "Wan2.2 T2V-A14B",
            "wan2_2.yaml",
            _wan_build(WAN_A14B),
            _wan_inputs(8, 4, per_token_timesteps=False),
            _cfg_if_guided,
            frames=81,
            frames_why="the model card's and WanPipeline's default (the deploy file sets none)",
        ),
    )
}
