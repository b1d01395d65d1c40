"""Random-weight GLM-Image at the published sizes, in the hub layout of `zai-org/GLM-Image`.

`vllm-omni-plugin make-tiny-model glm-image DIR --size full` writes the same folders as the tiny
build (see `tiny_glm_image`) with every component at the size the published checkpoint has and
random bf16 weights: about 10B parameters for the AR `vision_language_encoder`, 7B for the DiT.

Where each size comes from (no hub access here, so the hub's config files could not be read
directly; each value is taken from code that loads the published checkpoint):

- AR text model (`GlmImageTextConfig`): transformers 5.19 `configuration_glm_image.py` defaults,
  documented there as "a similar configuration to that of GLM-Image": vocab 168064, hidden 4096,
  intermediate 13696, 40 layers, 32 heads, 2 kv heads, vision_vocab 16512, rms eps 1e-5, qkv bias.
  The same numbers, plus the rope parameters (theta 10000, partial_rotary_factor 0.5,
  mrope_section [8, 12, 12]) and image start/end/token ids 16384/16385/167855, are the ones
  ollama's GLM-Image port reads from the hub's `vision_language_encoder/config.json`
  (ollama/ollama x/imagegen/models/glm_image/vision_language_encoder.go). head_dim 128 =
  4096 / 32, so sum(mrope_section) = 32 = 128 * 0.5 / 2.
- AR vision encoder and VQ: transformers 5.19 `GlmImageVisionConfig` / `GlmImageVQVAEConfig`
  defaults (depth 40, hidden 1536, 16 heads, intermediate 6144, patch 16, image size 2048,
  spatial merge 1; VQ embed 2048, 16384 codes, latent channels 1536 = vision hidden).
- DiT (`GlmImageTransformer2DModel`): 30 layers, 32 heads x 128 (inner 4096), text_embed 1472,
  time_embed 512, condition 256, codebook 16384, patch 2, 16 channels: sglang's
  `GlmImageArchConfig` (multimodal_gen/configs/models/dits/glmimage.py) and ollama's
  `DiffusionConfig` (transformer.go, "HiddenDim = 4096", "the 7B diffusion decoder").
  diffusers 0.42.1's constructor defaults (64 heads x 40) would give a 2.4B DiT, not the
  published 7B; 32 x 128 gives 7.0B.
- Text encoder: the glyph ByT5 encoder (T5EncoderModel) at byt5-small size: d_model 1472 (= the
  DiT's text_embed_dim), d_ff 3584, d_kv 64, 6 heads, 12 layers, vocab 384, gated-gelu, eps 1e-6
  (ollama text_encoder.go, which reads the hub's text_encoder/config.json).
- VAE (`AutoencoderKL`): block_out_channels [128, 512, 1024, 1024], 3 layers per block,
  16 latent channels, 32 norm groups, scaling_factor 0.18215, shift_factor None, 16-value
  latents_mean / latents_std (ollama vae.go). The trained mean/std values are not public in
  any source here: random values of the right shape are written.
- Scheduler: FlowMatchEulerDiscreteScheduler, 1000 train steps, base/max shift 0.25/0.75,
  base/max image seq len 256/4096, use_dynamic_shifting, time_shift_type "linear"
  (ollama scheduler.go DefaultSchedulerConfig).
- Tokenizer ids: image codes 0-16383, image start/end 16384/16385 (`<|dit_token_N|>`), text from
  16512 on; `<sop>`/`<eop>` 167845/167846 (ollama glm_tokenizer.go). The text part is GLM-4's
  vocabulary shifted by 16512 (167855 = 151343 `<|image|>` of GLM-4.1V + 16512), so GLM-4's
  special tokens sit at their id + 16512. The real BPE merges are not available: text is
  byte-level (256 byte tokens from 16512), the other ids up to 168064 hold unreachable
  placeholders so the tokenizer has the real size.

Random weights are made where they will live: on the GPU when there is one (modules are
constructed under `torch.device("cuda")` in bf16 and initialised by their own libraries'
initialisers), then each component's state dict is written shard by shard (5 GB, as on the hub)
with safetensors, so the host never holds more than one shard and never an fp32 copy.

`num_layers` (CLI `--num-layers`) overrides the depth of every stack (AR text and vision, DiT,
T5) and keeps every width: the CPU tests build the full-width model through this same code path.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_omni_plugin.testing.tiny_glm_image import TokenLayout, build_processor

logger = logging.getLogger(__name__)

NUM_IMAGE_CODES = 16384
IMAGE_START_ID = 16384
IMAGE_END_ID = 16385
VISION_VOCAB_SIZE = 16512
TEXT_VOCAB_SIZE = 168064
# GLM-4 (GLM-4.1V) special tokens at their GLM-4 id + VISION_VOCAB_SIZE.
_GLM4_SPECIALS = [
    "<|endoftext|>",  # 151329
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",  # 151333 -> 167845
    "<eop>",  # 151334 -> 167846
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",  # 151343 -> 167855 = image_token_id
]
SPECIALS = {tok: VISION_VOCAB_SIZE + 151329 + i for i, tok in enumerate(_GLM4_SPECIALS)}
PAD_ID = SPECIALS["<|endoftext|>"]
GRID_BOS_ID = SPECIALS["<sop>"]
GRID_EOS_ID = SPECIALS["<eop>"]
IMAGE_TOKEN_ID = SPECIALS["<|image|>"]

FULL_LAYOUT = TokenLayout(
    num_image_codes=NUM_IMAGE_CODES,
    vision_vocab_size=VISION_VOCAB_SIZE,
    text_vocab_size=TEXT_VOCAB_SIZE,
    specials=SPECIALS,
    # One 16x16 patch per vision token (vision patch 16, spatial merge 1, images only);
    # size bounds are smart_resize's defaults in transformers' GLM-Image image processor.
    image_processor={
        "patch_size": 16,
        "temporal_patch_size": 1,
        "merge_size": 1,
        "min_pixels": 512 * 512,
        "max_pixels": 2048 * 2048,
    },
    fill_holes=True,
)

AR_TEXT = {
    "vocab_size": TEXT_VOCAB_SIZE,
    "vision_vocab_size": VISION_VOCAB_SIZE,
    "hidden_size": 4096,
    "intermediate_size": 13696,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "attention_bias": True,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "pad_token_id": PAD_ID,
    "eos_token_id": IMAGE_END_ID,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [8, 12, 12],
    },
}
AR_VISION = {
    "depth": 40,
    "hidden_size": 1536,
    "num_heads": 16,
    "intermediate_size": 6144,
    "hidden_act": "gelu",
    "attention_bias": True,
    "patch_size": 16,
    "image_size": 2048,
    "spatial_merge_size": 1,
    "layer_norm_eps": 1e-6,
    "in_channels": 3,
}
AR_VQ = {"embed_dim": 2048, "num_embeddings": NUM_IMAGE_CODES, "latent_channels": 1536}

DIT = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 30,
    "attention_head_dim": 128,
    "num_attention_heads": 32,
    "text_embed_dim": 1472,
    "time_embed_dim": 512,
    "condition_dim": 256,
    "prior_vq_quantizer_codebook_size": NUM_IMAGE_CODES,
}

T5 = {
    "vocab_size": 384,
    "d_model": 1472,
    "d_kv": 64,
    "d_ff": 3584,
    "num_layers": 12,
    "num_heads": 6,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-6,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "is_encoder_decoder": False,
    "use_cache": False,
}

VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 512, 1024, 1024],
    "layers_per_block": 3,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.18215,
    "shift_factor": None,
}

SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.25,
    "max_shift": 0.75,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "linear",
}

# Shard size of the hub's safetensors files.
MAX_SHARD_BYTES = 5 * 10**9


def full_configs(num_layers: int | None = None) -> dict:
    """The configs of every component (no weights): `num_layers` overrides each stack's depth."""
    from transformers import GlmImageConfig, T5Config

    text, vision, dit, t5 = dict(AR_TEXT), dict(AR_VISION), dict(DIT), dict(T5)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        text["num_hidden_layers"] = vision["depth"] = dit["num_layers"] = t5["num_layers"] = (
            num_layers
        )
    ar = GlmImageConfig(
        text_config=text,
        vision_config=vision,
        vq_config=dict(AR_VQ),
        image_token_id=IMAGE_TOKEN_ID,
        image_start_token_id=IMAGE_START_ID,
        image_end_token_id=IMAGE_END_ID,
    )
    ar.architectures = ["GlmImageForConditionalGeneration"]
    ar.dtype = torch.bfloat16
    return {
        "vision_language_encoder": ar,
        "generation": generation_config(),
        "transformer": dit,
        "text_encoder": T5Config(**t5),
        "vae": dict(VAE),
        "scheduler": dict(SCHEDULER),
    }


def generation_config():
    """Sampling as the pipeline uses it, plus what keeps random weights on the image grid.

    As in the tiny build: ids from the image-start token up (never sampled by the trained model,
    and beyond the DiT's 16384-entry codebook) are pushed down, and EOS is forced at the last
    budgeted token, so transformers' `generate` writes exactly the grid codes then EOS.
    vLLM ignores both fields; the plugin's AR stage constrains generation itself.
    """
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=0.9,
        top_p=0.75,
        bos_token_id=IMAGE_START_ID,
        eos_token_id=IMAGE_END_ID,
        pad_token_id=PAD_ID,
        forced_eos_token_id=IMAGE_END_ID,
        sequence_bias=[[[i], -1.0e4] for i in range(NUM_IMAGE_CODES, VISION_VOCAB_SIZE)],
    )


def _construct(factory: Callable[[], torch.nn.Module], device: torch.device, seed: int):
    """Build a module directly on `device` in bf16 with its library's own random init.

    A transformers model is built with initialisation off, then initialised once by its own
    `init_weights` (as `from_pretrained` initialises the weights a checkpoint lacks): built
    plainly, each layer initialises itself and each nested model's `post_init` initialises
    everything again, three passes over UMT5-XXL's 1.05B-entry embedding table (~24 s of one
    CPU core)."""
    from transformers import PreTrainedModel

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights

    with torch.device("meta"):  # which library it comes from, in milliseconds
        once = isinstance(factory(), PreTrainedModel)
    torch.manual_seed(seed)  # seeds CUDA too
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            if once:
                with no_init_weights():
                    module = factory()
                module.init_weights()
            else:
                module = factory()
    finally:
        torch.set_default_dtype(previous)
    return module.eval().requires_grad_(False)


def write_safetensors(
    state: dict[str, torch.Tensor], out_dir: Path, stem: str, max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[str]:
    """Write `state` as `{stem}.safetensors`, or as `{stem}-0000i-of-0000n.safetensors` shards
    plus `{stem}.safetensors.index.json` when it exceeds `max_shard_bytes` (the hub's layout).

    Each shard is copied to the host only while it is written. Returns the file names.
    """
    from safetensors.torch import save_file

    shards: list[list[str]] = [[]]
    size = total = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out_dir.mkdir(parents=True, exist_ok=True)
    for keys, file_name in zip(shards, names, strict=True):
        save_file(
            {k: state[k].contiguous() for k in keys}, out_dir / file_name, metadata={"format": "pt"}
        )
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: f for keys, f in zip(shards, names, strict=True) for k in keys},
        }
        (out_dir / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = module.state_dict()
    seen: dict[int, str] = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:  # safetensors refuses shared storage; these models tie nothing
            raise ValueError(f"{name} shares storage with {seen[ptr]}")
        seen[ptr] = name
    return state


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build(
    out_dir: Path,
    seed: int,
    num_layers: int | None = None,
    device: str | torch.device | None = None,
    report: Callable[[str], None] = print,
) -> Path:
    """Write the full-size random GLM-Image to `out_dir`; report sizes and timings as it goes."""
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImageTransformer2DModel
    from transformers import ByT5Tokenizer, GlmImageForConditionalGeneration, T5EncoderModel

    out_dir = Path(out_dir)
    device = torch.device(device) if device is not None else default_device()
    configs = full_configs(num_layers)
    started = time.perf_counter()
    counts: dict[str, int] = {}

    def big(
        name: str, factory: Callable[[], torch.nn.Module], write_config, stem: str, offset: int
    ):
        t0 = time.perf_counter()
        module = _construct(factory, device, seed + offset)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        counts[name] = _count(module)
        files = write_safetensors(_state_dict(module), out_dir / name, stem)
        write_config(module, out_dir / name)
        t2 = time.perf_counter()
        report(
            f"{name}: {counts[name] / 1e9:.3f}B params, init {t1 - t0:.1f}s on {device}, "
            f"write {t2 - t1:.1f}s ({len(files)} file(s))"
        )
        del module
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def write_ar_config(module, path: Path) -> None:
        module.config.save_pretrained(path)
        configs["generation"].save_pretrained(path)

    big(
        "vision_language_encoder",
        lambda: GlmImageForConditionalGeneration(configs["vision_language_encoder"]),
        write_ar_config,
        "model",
        0,
    )
    big(
        "transformer",
        lambda: GlmImageTransformer2DModel(**configs["transformer"]),
        lambda module, path: module.save_config(path),
        "diffusion_pytorch_model",
        2,
    )
    # The small ones (0.2B, 0.08B) go through their libraries' own save_pretrained.
    t0 = time.perf_counter()
    text_encoder = _construct(lambda: T5EncoderModel(configs["text_encoder"]), device, seed + 1)
    counts["text_encoder"] = _count(text_encoder)
    text_encoder.save_pretrained(out_dir / "text_encoder", max_shard_size="5GB")
    del text_encoder
    gen = torch.Generator().manual_seed(seed)
    vae_config = dict(configs["vae"])
    vae_config["latents_mean"] = (torch.randn(16, generator=gen) * 0.5).tolist()
    vae_config["latents_std"] = (1.0 + torch.rand(16, generator=gen) * 2.0).tolist()
    vae = _construct(lambda: AutoencoderKL(**vae_config), device, seed + 3)
    counts["vae"] = _count(vae)
    vae.save_pretrained(out_dir / "vae")
    del vae
    FlowMatchEulerDiscreteScheduler(**configs["scheduler"]).save_pretrained(out_dir / "scheduler")
    ByT5Tokenizer().save_pretrained(out_dir / "tokenizer")
    build_processor(out_dir / "processor", layout=FULL_LAYOUT)
    report(
        f"text_encoder: {counts['text_encoder'] / 1e9:.3f}B params, vae: "
        f"{counts['vae'] / 1e9:.3f}B params, processor/tokenizer/scheduler "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    index = {
        "_class_name": "GlmImagePipeline",
        "_diffusers_version": diffusers.__version__,
        "processor": ["transformers", "GlmImageProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "ByT5Tokenizer"],
        "transformer": ["diffusers", "GlmImageTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "vision_language_encoder": ["transformers", "GlmImageForConditionalGeneration"],
    }
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    total = sum(counts.values())
    report(
        f"GLM-Image full size{'' if num_layers is None else f' ({num_layers} layers per stack)'}: "
        f"{total / 1e9:.2f}B params in bf16 written to {out_dir} in "
        f"{time.perf_counter() - started:.1f}s"
    )
    return out_dir
