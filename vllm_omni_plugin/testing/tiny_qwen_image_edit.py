"""Tiny random-weight Qwen-Image-Edit checkpoint in the hub layout of `Qwen/Qwen-Image-Edit`.

Folder (written by `QwenImageEditPipeline.save_pretrained`, as on the hub)::

    model_index.json
    processor/      Qwen2VLProcessor: the tokenizer below + Qwen2VLImageProcessor with the real
                    checkpoint's settings (14 px patches, 2x2 merge, 2 frames per patch, CLIP
                    mean/std, min/max pixels): the source image reaches the text encoder's
                    vision tower exactly as with the real processor
    text_encoder/   transformers Qwen2_5_VLForConditionalGeneration (hidden 32, a 1-block
                    vision tower with the real patch/merge geometry)
    tokenizer/      Qwen2Tokenizer (byte-level BPE)
    transformer/    QwenImageTransformer2DModel (joint_attention_dim = text hidden size)
    vae/            AutoencoderKLQwenImage (z_dim 16, spatial scale 8, as the real one)
    scheduler/      FlowMatchEulerDiscreteScheduler (dynamic shifting, as the real one)

Tokenizer id layout (the real one scaled down; real ids in brackets)::

    0 .. 255     byte-level tokens
    256 .. 999   merges: every word of QwenImageEditPipeline's system prompt is one token, as
                 in the real vocabulary, so the template prefix up to the image is exactly 64
                 tokens and `prompt_template_encode_start_idx = 64` drops precisely it
    1000 ..1013  "<|endoftext|>" (151643) ... "<|vision_start|>" 1009 (151652), "<|image_pad|>"
                 1012 (151655), "<|video_pad|>" 1013 (151656), in the real order
    vocab_size = 1024 (152064)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm_omni_plugin.testing.tiny_qwen_image import SPECIAL_TOKENS

SPECIAL_OFFSET = 1000
VOCAB_SIZE = 1024
TEMPLATE_PREFIX_TOKENS = 64  # QwenImageEditPipeline.prompt_template_encode_start_idx
TEXT_HIDDEN = 32

# The system prompt of QwenImageEditPipeline, word by word as byte-level BPE pre-tokenizes it
# ("Ġ" = a leading space, "Ċ" = a newline), plus a few prompt words for tests.
_SYSTEM_PROMPT = (
    "Ġconsistency system Ċ Describe Ġthe Ġkey Ġfeatures Ġof Ġinput Ġimage Ġ( color , Ġshape Ġsize Ġtexture"
    " Ġobjects Ġbackground ), Ġthen Ġexplain Ġhow Ġuser 's Ġtext Ġinstruction Ġshould Ġalter"
    " Ġor Ġmodify . ĠGenerate Ġa Ġnew Ġthat Ġmeets Ġrequirements Ġwhile Ġmaintaining"
    " Ġwith Ġoriginal Ġwhere Ġappropriate user"
)
_PROMPT_WORDS = "Ġred Ġblue Ġcube Ġcat Ġmake Ġit Ġturn Ġinto Ġsky"
_MERGED_WORDS = tuple(w for w in (_SYSTEM_PROMPT + " " + _PROMPT_WORDS).split() if len(w) > 1)

# Qwen2VLImageProcessor of the real checkpoint (processor/preprocessor_config.json).
IMAGE_PROCESSOR = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _token_id(name: str) -> int:
    return SPECIAL_OFFSET + SPECIAL_TOKENS.index(name)


def build_tokenizer():
    """Qwen2Tokenizer over the tiny vocabulary above (the class builds its own pre-tokenizer)."""
    from transformers import Qwen2Tokenizer

    from vllm_omni_plugin.testing.tiny_tokenizers import byte_alphabet, small_merges

    vocab = {ch: i for i, ch in enumerate(byte_alphabet())}
    merges = small_merges(list(_MERGED_WORDS))
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    if len(vocab) > SPECIAL_OFFSET:
        raise AssertionError(f"tiny Qwen-Image-Edit vocab overflows into special ids: {len(vocab)}")
    vocab.update({name: _token_id(name) for name in SPECIAL_TOKENS})
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        extra_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
    )


def write_processor(folder: Path) -> None:
    """processor/ as on the hub: the tokenizer files, preprocessor_config.json (the image
    processor) and video_preprocessor_config.json. Written piece by piece: transformers'
    Qwen2VLProcessor cannot be built without torchvision (its video processor needs it), which
    this environment lacks; the files are the same."""
    from transformers import Qwen2VLImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(folder)
    Qwen2VLImageProcessor(**IMAGE_PROCESSOR).save_pretrained(folder)
    video = {"video_processor_type": "Qwen2VLVideoProcessor", **IMAGE_PROCESSOR}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (folder / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2) + "\n"
    )


def _text_encoder(seed: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                "vocab_size": VOCAB_SIZE,
                "hidden_size": TEXT_HIDDEN,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "max_position_embeddings": 8192,
                "bos_token_id": _token_id("<|endoftext|>"),
                "eos_token_id": _token_id("<|im_end|>"),
                # sum(mrope_section) = head_dim / 2 (head_dim 16 here; real [16, 24, 24] for 128)
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [2, 3, 3],
                },
            },
            # The real tower's geometry (14 px patches, 2x2 merge, 2 frames), 1 block of width 32.
            vision_config={
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": TEXT_HIDDEN,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "fullatt_block_indexes": [0],
            },
            image_token_id=_token_id("<|image_pad|>"),
            video_token_id=_token_id("<|video_pad|>"),
            vision_start_token_id=_token_id("<|vision_start|>"),
            vision_end_token_id=_token_id("<|vision_end|>"),
        )
    ).eval()


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageTransformer2DModel,
    )

    text_encoder = _text_encoder(seed)

    torch.manual_seed(seed + 1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels packed 2x2
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim (real: 16, 56, 56)
    )

    torch.manual_seed(seed + 2)
    gen = torch.Generator().manual_seed(seed)
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=(torch.randn(16, generator=gen) * 0.5).tolist(),
        latents_std=(1.0 + torch.rand(16, generator=gen) * 2.0).tolist(),
    )

    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )

    tokenizer = build_tokenizer()
    pipe = QwenImageEditPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=None,  # written below
        transformer=transformer,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    write_processor(Path(out_dir) / "processor")
    index_file = Path(out_dir) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir
