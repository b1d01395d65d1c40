"""Tiny random-weight GLM-Image checkpoint in the hub layout of `zai-org/GLM-Image`.

Folder (written by `GlmImagePipeline.save_pretrained`, as on the hub)::

    model_index.json
    vision_language_encoder/  transformers GlmImageForConditionalGeneration + generation_config.json
    processor/                GlmImageProcessor: image processor, tokenizer.json, chat template
    tokenizer/                ByT5Tokenizer (glyph text)
    text_encoder/             T5EncoderModel (d_model = DiT text_embed_dim)
    transformer/              GlmImageTransformer2DModel
    vae/                      AutoencoderKL (scale 8) with latents_mean / latents_std
    scheduler/                FlowMatchEulerDiscreteScheduler (use_dynamic_shifting=True)

Token id layout of the AR model (the real one, scaled down; real ids in brackets)::

    0 .. 63      image codes "<|dit_token_0|>".. (0 .. 16383)
    64           image start "<|dit_token_64|>" = processor bos_token (16384)
    65           image end   "<|dit_token_65|>" = AR eos_token_id (16385)
    66 .. 127    unused vision ids (16386 .. 16511); vision_vocab_size = 128 (16512) = lm_head rows
    128 .. 383   256 byte-level text tokens (text BPE from 16512 on)
    384          "<|endoftext|>"  pad / tokenizer eos
    385, 386     "<sop>", "<eop>"  grid_bos_token, grid_eos_token
    387          "<|image|>"       image_token_id
    388 .. 511   unused; text vocab_size = 512 (168064)

The text-to-image prompt is `{prompt}<sop>{H/32} {W/32}<eop><sop>{ph} {pw}<eop><|dit_token_64|>`;
the AR then writes the preview grid, the H/32 x W/32 grid and EOS.

Random weights would sample any of the 128 vision ids, including EOS early, which a real
trained model never does. generation_config.json therefore pushes ids 64..127 down
(`sequence_bias`) and forces EOS at the last budgeted token (`forced_eos_token_id`), so
transformers' `generate` (and diffusers' pipeline) emit exactly grid codes then EOS, like the
real model. vLLM ignores these two fields; its AR stage constrains generation itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

NUM_IMAGE_CODES = 64
IMAGE_START_ID = 64
IMAGE_END_ID = 65
VISION_VOCAB_SIZE = 128
TEXT_OFFSET = 128
PAD_ID = 384
GRID_BOS_ID = 385
GRID_EOS_ID = 386
IMAGE_TOKEN_ID = 387
TEXT_VOCAB_SIZE = 512

# Keeps content only: the processor itself appends the grid suffix and image-start token.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}<|dit_token_64|><|image|><|dit_token_65|>"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
)


@dataclass(frozen=True)
class TokenLayout:
    """Where the AR's ids live: image codes from 0, then image start/end, then text from
    `vision_vocab_size` on (byte-level stand-ins first), with `specials` at fixed ids."""

    num_image_codes: int
    vision_vocab_size: int
    text_vocab_size: int
    # token -> id; must hold "<|endoftext|>" (pad), "<sop>", "<eop>" and "<|image|>".
    specials: dict[str, int]
    image_processor: dict = field(default_factory=dict)
    # Fill every id below text_vocab_size that has no token yet with an unreachable
    # placeholder, so len(tokenizer) equals the model's vocab (the real tokenizer has no holes).
    fill_holes: bool = False

    @property
    def image_start_id(self) -> int:
        return self.num_image_codes

    @property
    def image_end_id(self) -> int:
        return self.num_image_codes + 1

    @property
    def text_offset(self) -> int:
        return self.vision_vocab_size

    def chat_template(self) -> str:
        start, end = _dit_token(self.image_start_id), _dit_token(self.image_end_id)
        return CHAT_TEMPLATE.replace("<|dit_token_64|>", start).replace("<|dit_token_65|>", end)


TINY_LAYOUT = TokenLayout(
    num_image_codes=NUM_IMAGE_CODES,
    vision_vocab_size=VISION_VOCAB_SIZE,
    text_vocab_size=TEXT_VOCAB_SIZE,
    specials={
        "<|endoftext|>": PAD_ID,
        "<sop>": GRID_BOS_ID,
        "<eop>": GRID_EOS_ID,
        "<|image|>": IMAGE_TOKEN_ID,
    },
    # Patch 16 with no temporal/spatial merge: one vision patch per 16x16 pixels.
    image_processor={
        "patch_size": 16,
        "temporal_patch_size": 1,
        "merge_size": 1,
        "min_pixels": 32 * 32,
        "max_pixels": 256 * 256,
    },
)


def _dit_token(i: int) -> str:
    return f"<|dit_token_{i}|>"


def build_processor(out_dir: Path | None = None, layout: TokenLayout = TINY_LAYOUT):
    """GlmImageProcessor with `layout`'s ids (saved to `out_dir` if given)."""
    from transformers import GlmImageImageProcessor, GlmImageProcessor, PreTrainedTokenizerFast

    from vllm_omni_plugin.testing.tiny_tokenizers import byte_alphabet, byte_level_bpe

    vocab = {_dit_token(i): i for i in range(layout.vision_vocab_size)}
    vocab.update({ch: layout.text_offset + b for b, ch in enumerate(byte_alphabet())})
    vocab.update(layout.specials)
    if layout.fill_holes:
        taken = set(vocab.values())
        # "<|text_N|>" is never produced: no merges lead to it and it is not an added token.
        vocab.update({f"<|text_{i}|>": i for i in range(layout.text_vocab_size) if i not in taken})
    # Vision ids are special too, so "<|dit_token_64|>" in text is one token, as in the real one.
    special_list = [_dit_token(i) for i in range(layout.vision_vocab_size)] + list(layout.specials)
    tok = byte_level_bpe(vocab, merges=[], special_tokens=special_list)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_dit_token(layout.image_start_id),
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image|>",
            "grid_bos_token": "<sop>",
            "grid_eos_token": "<eop>",
        },
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    image_processor = GlmImageImageProcessor(**layout.image_processor)
    processor = GlmImageProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=layout.chat_template()
    )
    if out_dir is not None:
        processor.save_pretrained(out_dir)
        # The image processor config on its own too (preprocessor_config.json, as hub processor
        # folders have it): a reader of that file alone must see patch 16 / merge 1, not the
        # class defaults (patch 14, merge 2), which expand an image to a quarter of the tokens
        # its grid implies and leave vLLM without an image placeholder.
        image_processor.save_pretrained(out_dir)
    return processor


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        GlmImagePipeline,
        GlmImageTransformer2DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        GenerationConfig,
        GlmImageConfig,
        GlmImageForConditionalGeneration,
    )

    from vllm_omni_plugin.testing import tiny_flux

    glm_config = GlmImageConfig(
        text_config={
            "vocab_size": TEXT_VOCAB_SIZE,
            "vision_vocab_size": VISION_VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            # head_dim 32: the smallest vLLM's CPU attention accepts.
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "pad_token_id": PAD_ID,
            "eos_token_id": IMAGE_END_ID,
            # sum(mrope_section) = head_dim * partial_rotary_factor / 2 (real: [8, 12, 12] for 128).
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 3, 3],
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "num_heads": 1,
            "intermediate_size": 64,
            "patch_size": 16,
            "image_size": 256,
        },
        # latent_channels = vision hidden size; one code per AR image id.
        vq_config={"embed_dim": 32, "num_embeddings": NUM_IMAGE_CODES, "latent_channels": 32},
        image_token_id=IMAGE_TOKEN_ID,
        image_start_token_id=IMAGE_START_ID,
        image_end_token_id=IMAGE_END_ID,
    )
    torch.manual_seed(seed)
    ar = GlmImageForConditionalGeneration(glm_config).eval()
    ar.generation_config = GenerationConfig(
        do_sample=True,
        temperature=0.9,
        top_p=0.75,
        bos_token_id=IMAGE_START_ID,
        eos_token_id=IMAGE_END_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=IMAGE_END_ID,
        sequence_bias=[[[i], -1.0e4] for i in range(NUM_IMAGE_CODES, VISION_VOCAB_SIZE)],
    )

    # ByT5: 3 specials + 256 bytes + 125 extra ids.
    text_encoder = tiny_flux.build_t5_encoder(seed + 1, vocab_size=384)

    torch.manual_seed(seed + 2)
    transformer = GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        text_embed_dim=32,
        time_embed_dim=32,
        condition_dim=16,
        prior_vq_quantizer_codebook_size=VISION_VOCAB_SIZE,
    )

    gen = torch.Generator().manual_seed(seed)
    vae = tiny_flux.build_vae(
        seed + 3,
        scaling_factor=1.0,
        shift_factor=0.0,
        use_quant_conv=True,
        use_post_quant_conv=True,
        latents_mean=(torch.randn(16, generator=gen) * 0.1).tolist(),
        latents_std=(0.5 + torch.rand(16, generator=gen)).tolist(),
    )

    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.25,
        max_shift=0.75,
        base_image_seq_len=256,
        time_shift_type="linear",
    )

    processor = build_processor()
    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer(),
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=ar,
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    processor.image_processor.save_pretrained(out_dir / "processor")  # see build_processor
    return out_dir
