"""Tiny random-weight FLUX checkpoint in the hub layout of `black-forest-labs/FLUX.1-dev`.

Folder (written by `FluxPipeline.save_pretrained`, as on the hub)::

    model_index.json
    text_encoder/    CLIPTextModel (pooled prompt embedding; hidden 32)
    tokenizer/       CLIPTokenizer (byte-level BPE with "</w>" word ends, model_max_length 77)
    text_encoder_2/  T5EncoderModel (sequence embedding; d_model 32 = joint_attention_dim)
    tokenizer_2/     T5TokenizerFast (SentencePiece-style unigram, 100 <extra_id_N> tokens)
    transformer/     FluxTransformer2DModel (guidance_embeds=True, as FLUX.1-dev)
    vae/             AutoencoderKL (16 latent channels, scale 8, FLUX scaling/shift factors)
    scheduler/       FlowMatchEulerDiscreteScheduler (FLUX.1-dev's dynamic shifting settings)

CLIP ids: 0..255 bytes, 256..511 bytes + "</w>", then merges, then "<|startoftext|>" and
"<|endoftext|>" as the last two ids (49406, 49407 in the real vocab). T5 ids: "<pad>" 0,
"</s>" 1, "<unk>" 2, then pieces, then the 100 sentinel tokens.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

CLIP_MAX_LENGTH = 77
T5_DIM = 32
_WORDS = "a red cube cat photo of the and with".split()


def build_clip_tokenizer():
    """CLIPTokenizer over a tiny vocabulary (the class builds CLIP's own pre-tokenizer)."""
    from transformers import CLIPTokenizer

    from vllm_omni_plugin.testing.tiny_tokenizers import byte_alphabet, small_merges

    alphabet = byte_alphabet()
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({ch + "</w>": 256 + i for i, ch in enumerate(alphabet)})
    # CLIP's BPE starts each word as its characters with "</w>" glued to the last one.
    merges = small_merges([[*w[:-1], w[-1] + "</w>"] for w in _WORDS])
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        model_max_length=CLIP_MAX_LENGTH,
        pad_token="<|endoftext|>",
    )


def build_t5_tokenizer():
    """T5TokenizerFast over a tiny unigram vocabulary: characters, "▁"-words, a few whole words."""
    from transformers import T5TokenizerFast

    pieces: list[tuple[str, float]] = [
        ("<pad>", 0.0),
        ("</s>", 0.0),
        ("<unk>", 0.0),
        ("\u2581", -2.0),
    ]
    chars = string.ascii_letters + string.digits + string.punctuation
    pieces += [(ch, -8.0) for ch in chars]
    pieces += [("\u2581" + ch, -7.0) for ch in chars]
    pieces += [("\u2581" + w, -3.0 - 0.1 * i) for i, w in enumerate(_WORDS)]
    return T5TokenizerFast(vocab=pieces, extra_ids=100, model_max_length=512)


def build(out_dir: Path, seed: int, pipeline_class: str = "FluxPipeline") -> Path:
    """The checkpoint of `pipeline_class` (FluxPipeline, or FluxKontextPipeline: the same
    components, tiny_flux_kontext.py)."""
    import diffusers
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = build_clip_tokenizer()
    tokenizer_2 = build_t5_tokenizer()

    clip_hidden = 32
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=clip_hidden,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=CLIP_MAX_LENGTH,
            projection_dim=clip_hidden,
            hidden_act="quick_gelu",
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()

    text_encoder_2 = build_t5_encoder(seed + 1, vocab_size=len(tokenizer_2))

    torch.manual_seed(seed + 2)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels packed 2x2
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=T5_DIM,
        pooled_projection_dim=clip_hidden,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim (real: 16, 56, 56)
    )

    vae = build_vae(seed + 3)

    pipe = getattr(diffusers, pipeline_class)(
        scheduler=build_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    _name_t5_tokenizer_fast(out_dir / "model_index.json")
    return out_dir


def _name_t5_tokenizer_fast(index_file: Path) -> None:
    # transformers 5 made T5TokenizerFast an alias of T5Tokenizer, so save_pretrained records
    # "T5Tokenizer"; the hub's FLUX model_index.json says "T5TokenizerFast" (both load).
    index = json.loads(index_file.read_text())
    index["tokenizer_2"] = ["transformers", "T5TokenizerFast"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def build_t5_encoder(seed: int, vocab_size: int, umt5: bool = False):
    """T5EncoderModel of width 32 (2 gated-GELU layers), seeded with `seed`; GLM-Image's ByT5
    text encoder has the same shape, and Wan's UMT5EncoderModel (`umt5`) too."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (
        (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    )
    torch.manual_seed(seed)
    return model_class(
        config_class(
            vocab_size=vocab_size,
            d_model=T5_DIM,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
        )
    ).eval()


def build_scheduler():
    """FlowMatchEulerDiscreteScheduler with FLUX.1-dev's dynamic shifting (FLUX.2's too)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


# FLUX.1's VAE settings (Z-Image's too): its scaling and shift factors, no quant convs.
FLUX_VAE = {
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}


def build_vae(seed: int, **settings):
    """A tiny AutoencoderKL with 16 latent channels, seeded with `seed`, with FLUX_VAE's
    settings unless `settings` replaces them (GLM-Image's: its factors, latent statistics and
    quant convs)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=(8, 16, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        **{**FLUX_VAE, **settings},
    )
