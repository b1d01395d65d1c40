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

from vllm_omni_plugin.testing.tiny_qwen_image import (
    build_scheduler,
    build_text_encoder,
    build_transformer,
    build_vae,
    tokenizer_from_words,
)

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


def build_tokenizer():
    """Qwen2Tokenizer over the tiny vocabulary above (the class builds its own pre-tokenizer)."""
    return tokenizer_from_words(_MERGED_WORDS, SPECIAL_OFFSET, "Qwen-Image-Edit")


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


def build_text_encoder_vl(seed: int):
    """The Qwen2.5-VL text encoder over this vocabulary: the real tower's geometry (14 px
    patches, 2x2 merge, 2 frames), 1 block of width 32."""
    return build_text_encoder(
        seed,
        vocab_size=VOCAB_SIZE,
        special_offset=SPECIAL_OFFSET,
        hidden_size=TEXT_HIDDEN,
        max_position_embeddings=8192,
        vision_geometry={"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    )


def save_with_processor(pipe, out_dir: Path) -> Path:
    """`pipe` (built with `processor=None`) saved as on the hub: processor/ written piece by
    piece (`write_processor`) and named in model_index.json."""
    pipe.save_pretrained(out_dir, safe_serialization=True)
    write_processor(Path(out_dir) / "processor")
    index_file = Path(out_dir) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out_dir


def build(out_dir: Path, seed: int) -> Path:
    from diffusers import QwenImageEditPipeline

    text_encoder = build_text_encoder_vl(seed)
    transformer = build_transformer(seed, TEXT_HIDDEN)
    vae = build_vae(seed)
    pipe = QwenImageEditPipeline(
        scheduler=build_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=build_tokenizer(),
        processor=None,  # written by save_with_processor
        transformer=transformer,
    )
    return save_with_processor(pipe, out_dir)
