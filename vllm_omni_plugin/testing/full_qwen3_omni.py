"""Random-weight Qwen3-Omni at the published sizes, in the hub layout of
`Qwen/Qwen3-Omni-30B-A3B-Instruct`.

`vllm-omni-plugin make-tiny-model qwen3-omni DIR --size full` writes the same files as the tiny
build (see `tiny_qwen3_omni`) with every component at the published size and random bf16
weights: about 35B parameters (thinker 30B-A3B MoE with audio and vision encoders, talker
MoE with its code predictor, Code2Wav), about 70 GB.

Sizes are those of the published `config.json` as transformers 5.19's Qwen3-Omni classes and
vLLM's thinker read it (no hub access here): thinker text 48 layers, hidden 2048, 32 heads x
128, 4 kv heads, 128 experts (top 8, expert width 768), vocab 152064; audio encoder 32 layers,
d_model 1280; vision 27 layers, hidden 1152, deepstack (8, 16, 24); talker 20 layers, hidden
1024, 16 heads x 128, 2 kv heads, 128 experts (top 6, width 384, shared 768), codec vocab
3072, accept_hidden_layer 24; code predictor 5 layers, hidden 1024; 16 code groups of 2048
codes; Code2Wav 8 layers, hidden 1024, decoder 1536. Special ids at the real ones; text is
byte-level (the real merges are not available), the other ids hold unreachable placeholders.

Weights are made where they will live: on the GPU when there is one (modules constructed
under `torch.device("cuda")` in bf16), then written in 5 GB safetensors shards, a layer at a
time (`save_layer_by_layer`), so an 80 GB GPU and a host of twice the files' size suffice.
`num_layers` overrides the depth of every stack (widths unchanged) for CPU tests of this path.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from vllm_omni_plugin.testing.tiny_qwen3_omni import (
    build_tokenizer,
    generation_config,
    media_ids,
    token_ids,
    write_processor_files,
)

logger = logging.getLogger(__name__)

TEXT_VOCAB_SIZE = 152064
SPECIALS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<|audio_start|>": 151669,
    "<|audio_end|>": 151670,
    "<tts_pad>": 151671,
    "<tts_text_bos>": 151672,
    "<tts_text_eod>": 151673,
    "<tts_text_bos_single>": 151674,
    "<|audio_pad|>": 151675,
}
ROLE_IDS = {"user": 872, "assistant": 77091, "system": 8948}


def _mrope() -> dict:
    return {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [24, 20, 20],
        "interleaved": True,
        "mrope_interleaved": True,
    }


def code2wav_sizes(num_layers: int | None = None) -> dict:
    """The published Code2Wav's `code2wav_config` (`num_layers`: its transformer's depth)."""
    return {
        "codebook_size": 2048,
        "num_quantizers": 16,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8 if num_layers is None else num_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "sliding_window": 72,
        "max_position_embeddings": 8000,
        "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2],
        "decoder_dim": 1536,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }


def build_config(ids: dict[str, int], num_layers: int | None = None):
    from transformers import Qwen3OmniMoeConfig

    def depth(n: int) -> int:
        return n if num_layers is None else num_layers

    media = {**media_ids(SPECIALS), "position_id_per_seconds": 13}
    thinker_layers = depth(48)
    thinker = {
        **media,
        "user_token_id": ids["user_token_id"],
        "seconds_per_chunk": 2,
        "audio_config": {
            "num_mel_bins": 128,
            "d_model": 1280,
            "encoder_layers": depth(32),
            "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120,
            "output_dim": 2048,
            "downsample_hidden_size": 480,
            "n_window": 50,
            "n_window_infer": 400,
            "conv_chunksize": 500,
            "max_source_positions": 1500,
        },
        "vision_config": {
            "depth": depth(27),
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_heads": 16,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 2048,
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [i for i in (8, 16, 24) if i < depth(27)] or [0],
            "image_size": 768,  # vLLM's thinker: a 48 x 48 grid of 16-pixel patches
            "apply_vit_abs_pos_embed": True,
            "in_channels": 3,
        },
        "text_config": {
            "vocab_size": TEXT_VOCAB_SIZE,
            "hidden_size": 2048,
            "intermediate_size": 768,
            "moe_intermediate_size": 768,
            "num_hidden_layers": thinker_layers,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 65536,
            "rope_parameters": _mrope(),
            "tie_word_embeddings": False,
        },
    }
    talker = {
        **media,
        "codec_pad_id": 2148,
        "codec_bos_id": 2149,
        "codec_eos_token_id": 2150,
        "codec_nothink_id": 2155,
        "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "num_code_groups": 16,
        "thinker_hidden_size": 2048,
        # The input of thinker layer 24 (of 48); a shallower build reads its last layer's input.
        "accept_hidden_layer": min(24, thinker_layers - 1),
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "spatial_merge_size": 2,
        "code_predictor_config": {
            "vocab_size": 2048,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": depth(5),
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_code_groups": 16,
            "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "text_config": {
            "vocab_size": 3072,
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "moe_intermediate_size": 384,
            "shared_expert_intermediate_size": 768,
            "num_hidden_layers": depth(20),
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 6,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 65536,
            "rope_parameters": _mrope(),
        },
    }
    code2wav = code2wav_sizes(num_layers)
    config = Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
        **ids,
    )
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    return config


def build(out_dir: Path, seed: int, num_layers: int | None = None) -> Path:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from vllm_omni_plugin.testing.tiny_qwen3_omni import init_talker_experts, make_audible

    tokenizer = build_tokenizer(SPECIALS, role_ids=ROLE_IDS, vocab_size=TEXT_VOCAB_SIZE)
    ids = token_ids(tokenizer, SPECIALS)
    config = build_config(ids, num_layers)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = Qwen3OmniMoeForConditionalGeneration(config).eval()
            init_talker_experts(model)
            make_audible(model.code2wav, seed + 1)
    finally:
        torch.set_default_dtype(previous)
    model.config.torch_dtype = torch.bfloat16
    model.generation_config = generation_config(ids, SPECIALS)
    logger.info(
        "built %.1fB parameters on %s", sum(p.numel() for p in model.parameters()) / 1e9, device
    )
    save_layer_by_layer(model, out_dir)
    write_processor_files(out_dir, tokenizer)
    return out_dir


MAX_SHARD_BYTES = 5 * 10**9
_LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+\.)")


def save_layer_by_layer(model, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """The files `model.save_pretrained(out_dir, max_shard_size=...)` writes (config, generation
    config, the hub's per-expert weight names in indexed safetensors shards), converted to the
    hub's layout one decoder layer at a time.

    save_pretrained converts the whole state dict before writing its first shard: a second copy
    of every MoE layer's experts, which fits neither beside the ~66 GB model on an 80 GB GPU nor,
    moved to the host, beside files written to a RAM disk. Here a converted layer goes to the host
    and leaves it once its shard is written."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    groups: dict[str, list[str]] = {}
    for name in state:
        prefix = _LAYER_PREFIX.match(name)
        groups.setdefault(prefix.group(1) if prefix else "", []).append(name)

    shard_files: list[tuple[str, list[str]]] = []  # (temporary name, tensor names)
    pending: dict[str, torch.Tensor] = {}
    total = 0

    def flush() -> None:
        temporary = f"shard-{len(shard_files)}.tmp"
        save_file(pending, out_dir / temporary, metadata={"format": "pt"})
        shard_files.append((temporary, list(pending)))
        pending.clear()

    for names in groups.values():
        converted = revert_weight_conversion(model, {n: state[n] for n in names})
        layer = {n: t.detach().to("cpu").contiguous() for n, t in converted.items()}
        del converted
        nbytes = sum(t.numel() * t.element_size() for t in layer.values())
        pending_bytes = sum(t.numel() * t.element_size() for t in pending.values())
        if pending and pending_bytes + nbytes > max_shard_bytes:
            flush()
        pending.update(layer)
        total += nbytes
    if pending:
        flush()

    count = len(shard_files)
    weight_map = {}
    for i, (temporary, names) in enumerate(shard_files):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        (out_dir / temporary).rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
