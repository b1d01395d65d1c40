"""Tiny random-weight Qwen3-Omni checkpoint in the hub layout of `Qwen/Qwen3-Omni-30B-A3B-Instruct`.

Folder (as on the hub; written by transformers' `save_pretrained`)::

    config.json                 Qwen3OmniMoeConfig: thinker_config, talker_config, code2wav_config,
                                enable_audio_output, tts_* / im_* / role token ids
    generation_config.json
    model.safetensors           thinker.*, talker.*, code2wav.* (random, seeded)
    tokenizer.json, tokenizer_config.json, chat_template.jinja
    preprocessor_config.json, video_preprocessor_config.json

It loads in transformers' `Qwen3OmniMoeForConditionalGeneration` (thinker + talker + Code2Wav;
`generate(..., return_audio=True)` returns a 24 kHz waveform) and vLLM's own
`Qwen3OmniMoeThinkerForConditionalGeneration` serves its thinker on a CPU (head_dim 32, the
smallest vLLM's CPU attention takes).

Text token layout (the real ids in brackets)::

    0 .. 255     byte-level stand-ins
    256 ..       BPE merges that make the role words one token each (as in the real vocabulary,
                 where the talker finds "user" / "assistant" right after `<|im_start|>`)
    SPECIALS     `<|endoftext|>`, `<|im_start|>` (151644), `<|im_end|>` (151645), the audio / vision
                 markers and pads, `<tts_pad>` (151671), `<tts_text_bos>` (151672),
                 `<tts_text_eod>` (151673) ... at fixed ids from 400; text vocab_size 512

Codec (talker) layout: codes 0..63 (the code2wav codebook, 2048 real), then the codec specials
(pad, bos, eos, nothink, think bos/eos), then the speakers; vocab 1088 = 64 + 1024, because
transformers' `generate` suppresses the top 1024 ids of the codec vocabulary (all but EOS) and
the codes must sit below them. 4 code groups (16 real); 1920 samples per frame at 24 kHz as in
the real Code2Wav (upsampling 8*5*4*3 * 2*2), with narrow channels.
"""

from __future__ import annotations

from pathlib import Path

import torch

SAMPLE_RATE = 24000
TEXT_VOCAB_SIZE = 512
ROLE_WORDS = ["user", "assistant", "system"]
# token -> id, at fixed ids above the byte stand-ins and the role merges.
SPECIALS = {
    "<|endoftext|>": 400,
    "<|im_start|>": 401,
    "<|im_end|>": 402,
    "<|audio_start|>": 403,
    "<|audio_end|>": 404,
    "<|audio_pad|>": 405,
    "<|vision_start|>": 406,
    "<|vision_end|>": 407,
    "<|image_pad|>": 408,
    "<|video_pad|>": 409,
    "<tts_pad>": 410,
    "<tts_text_bos>": 411,
    "<tts_text_eod>": 412,
    "<tts_text_bos_single>": 413,
}
CODEBOOK_SIZE = 64
NUM_CODE_GROUPS = 4
CODEC_VOCAB_SIZE = CODEBOOK_SIZE + 1024
CODEC_IDS = {
    "codec_pad_id": 64,
    "codec_bos_id": 65,
    "codec_eos_token_id": 66,
    "codec_nothink_id": 67,
    "codec_think_bos_id": 68,
    "codec_think_eos_id": 69,
}
SPEAKERS = {"chelsie": 70, "ethan": 71, "aiden": 72}
ACCEPT_HIDDEN_LAYER = 2

# Qwen's ChatML with the multimodal placeholders vLLM's Qwen3-Omni thinker expects.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] in ('image', 'image_url') -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] in ('audio', 'input_audio', 'audio_url') -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif item['type'] in ('video', 'video_url') -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def token_ids(tokenizer, specials: dict[str, int] = SPECIALS) -> dict[str, int]:
    """The text ids the top-level config names (im_start, tts_*, role words)."""
    vocab = tokenizer.get_vocab()
    return {
        "im_start_token_id": specials["<|im_start|>"],
        "im_end_token_id": specials["<|im_end|>"],
        "tts_pad_token_id": specials["<tts_pad>"],
        "tts_bos_token_id": specials["<tts_text_bos>"],
        "tts_eos_token_id": specials["<tts_text_eod>"],
        "system_token_id": vocab["system"],
        "user_token_id": vocab["user"],
        "assistant_token_id": vocab["assistant"],
    }


def media_ids(specials: dict[str, int] = SPECIALS) -> dict[str, int]:
    """The audio / vision marker ids the thinker and talker configs name."""
    return {
        "audio_token_id": specials["<|audio_pad|>"],
        "image_token_id": specials["<|image_pad|>"],
        "video_token_id": specials["<|video_pad|>"],
        "audio_start_token_id": specials["<|audio_start|>"],
        "audio_end_token_id": specials["<|audio_end|>"],
        "vision_start_token_id": specials["<|vision_start|>"],
        "vision_end_token_id": specials["<|vision_end|>"],
    }


def build_tokenizer(
    specials: dict[str, int] = SPECIALS,
    role_ids: dict[str, int] | None = None,
    vocab_size: int | None = None,
):
    """A Qwen-style byte-level BPE with the Qwen3-Omni special tokens at `specials`' ids.

    The role words are one token each (merges), at `role_ids` when given (the real ids);
    `vocab_size` fills every id without a token with an unreachable placeholder, so the
    tokenizer has the model's size.
    """
    from transformers import PreTrainedTokenizerFast

    from vllm_omni_plugin.testing.tiny_tokenizers import byte_alphabet, byte_level_bpe, small_merges

    vocab = {ch: b for b, ch in enumerate(byte_alphabet())}
    merges = small_merges(ROLE_WORDS)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    for word, idx in (role_ids or {}).items():
        vocab[word] = idx
    assert not set(vocab.values()) & set(specials.values())
    vocab.update(specials)
    if vocab_size is not None:
        taken = set(vocab.values())
        vocab.update({f"<|unused_{i}|>": i for i in range(vocab_size) if i not in taken})
    tok = byte_level_bpe(vocab, merges=merges, special_tokens=list(specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )


PIXELS = {"min_pixels": 32 * 32, "max_pixels": 128 * 128}


def write_processor_files(out_dir: Path, tokenizer=None) -> None:
    """The processor files of the hub folder: tokenizer, `preprocessor_config.json` (Whisper
    features, 128 mels at 16 kHz, merged with the Qwen2-VL image processor's fields: patch 16,
    merge 2, temporal patch 2, small pixel bounds, as the hub file merges them),
    `video_preprocessor_config.json`, `chat_template.jinja`.

    Written from the sub-processors' own `to_dict` (the video processor's fields by hand: its
    transformers class needs torchvision, which the CPU environment does not have), so loading
    goes through the same code as the hub folder's.
    """
    import json

    from transformers import Qwen2VLImageProcessor, WhisperFeatureExtractor

    tokenizer = tokenizer or build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    image = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, **PIXELS)
    features = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    merged = {**features.to_dict(), **image.to_dict(), "processor_class": "Qwen3OmniMoeProcessor"}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(merged, indent=2) + "\n")
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "processor_class": "Qwen3OmniMoeProcessor",
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": PIXELS["min_pixels"], "longest_edge": PIXELS["max_pixels"]},
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": image.image_mean,
        "image_std": image.image_std,
        "rescale_factor": image.rescale_factor,
    }
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _mrope(head_dim: int) -> dict:
    # Interleaved 3-D rope; sum(mrope_section) = head_dim / 2 (real: [24, 20, 20] for 128).
    third = head_dim // 6
    section = [head_dim // 2 - 2 * third, third, third]
    return {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": section,
        "interleaved": True,
        "mrope_interleaved": True,
    }


def build_config(ids: dict[str, int] | None = None):
    """The tiny `Qwen3OmniMoeConfig` (sizes in the module docstring)."""
    from transformers import Qwen3OmniMoeConfig

    ids = ids or token_ids(build_tokenizer())
    media = {**media_ids(), "position_id_per_seconds": 13}
    thinker_hidden = 64
    thinker = {
        **media,
        "user_token_id": ids["user_token_id"],
        "seconds_per_chunk": 2,
        "audio_config": {
            "num_mel_bins": 128,
            "d_model": 64,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "output_dim": thinker_hidden,
            "downsample_hidden_size": 16,
            "n_window": 50,
            "n_window_infer": 400,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": thinker_hidden,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
            # Read by vLLM's thinker (not by transformers): the grid of the position
            # embedding is image_size / patch_size per side (8 x 8 = 64 here).
            "image_size": 128,
            "apply_vit_abs_pos_embed": True,
            "in_channels": 3,
        },
        "text_config": {
            "vocab_size": TEXT_VOCAB_SIZE,
            "hidden_size": thinker_hidden,
            "intermediate_size": 64,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 4096,
            "rope_parameters": _mrope(32),
            "tie_word_embeddings": False,
        },
    }
    talker = {
        **media,
        **CODEC_IDS,
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": thinker_hidden,
        "accept_hidden_layer": ACCEPT_HIDDEN_LAYER,
        "speaker_id": dict(SPEAKERS),
        "spatial_merge_size": 2,
        "code_predictor_config": {
            "vocab_size": CODEBOOK_SIZE,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "num_code_groups": NUM_CODE_GROUPS,
            "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "text_config": {
            "vocab_size": CODEC_VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 64,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 4096,
            "rope_parameters": _mrope(32),
        },
    }
    code2wav = {
        "codebook_size": CODEBOOK_SIZE,
        "num_quantizers": NUM_CODE_GROUPS,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        **ids,
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return config


def generation_config(ids: dict[str, int], specials: dict[str, int] = SPECIALS):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=specials["<|endoftext|>"],
        eos_token_id=[ids["im_end_token_id"], specials["<|endoftext|>"]],
        pad_token_id=specials["<|endoftext|>"],
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
    )


def init_talker_experts(model) -> None:
    """Draw the talker's MoE expert and router weights (std initializer_range) from the seeded
    global generator: transformers 5.19's `_init_weights` covers the thinker's MoE blocks but
    not the talker's, whose 3-D expert tensors would otherwise hold uninitialised memory."""
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

    std = model.config.talker_config.text_config.initializer_range
    with torch.no_grad():
        for module in model.talker.modules():
            if isinstance(module, hf.Qwen3OmniMoeTalkerTextSparseMoeBlock):
                module.experts.gate_up_proj.normal_(0.0, std)
                module.experts.down_proj.normal_(0.0, std)
                module.gate.weight.normal_(0.0, std)


def make_audible(code2wav, seed: int, target_std: float = 0.2) -> None:
    """Re-draw Code2Wav's convolutions at unit gain (std 1/sqrt(fan_in)) and its code embedding
    at std 1, then scale the last convolution so random codes give a waveform of std
    `target_std`: with the library's init (std 0.02 everywhere) the tiny decoder's output is
    ~1e-7, which no waveform tolerance could tell from silence."""
    import math

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in code2wav.modules():
            if isinstance(mod, torch.nn.Conv1d):
                fan_in = mod.weight.shape[1] * mod.weight.shape[2]
            elif isinstance(mod, torch.nn.ConvTranspose1d):
                fan_in = mod.weight.shape[0] * mod.weight.shape[2] // mod.stride[0]
            else:
                continue
            mod.weight.copy_(
                torch.randn(mod.weight.shape, generator=gen, device="cpu") / math.sqrt(fan_in)
            )
        emb = code2wav.code_embedding.weight
        emb.copy_(torch.randn(emb.shape, generator=gen, device="cpu"))
        last = code2wav.decoder[-1].conv
        last.bias.zero_()
        cfg = code2wav.config
        codes = torch.randint(
            0, cfg.codebook_size, (1, cfg.num_quantizers, 32), generator=gen, device="cpu"
        ).to(emb.device)
        hidden = code2wav.code_embedding(codes + code2wav.code_offset).mean(1)
        hidden = code2wav.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        for blocks in code2wav.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in code2wav.decoder:
            hidden = block(hidden)
        last.weight.mul_(target_std / hidden.std())


def build(out_dir: Path, seed: int) -> Path:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    tokenizer = build_tokenizer()
    ids = token_ids(tokenizer)
    config = build_config(ids)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    init_talker_experts(model)
    make_audible(model.code2wav, seed + 1)
    model.generation_config = generation_config(ids)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_processor_files(out_dir, tokenizer)
    return out_dir
