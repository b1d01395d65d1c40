"""GLM-Image request preparation and output post-processing for the AR stage.

prompt + size -> prompt token ids (GLM-Image's own processor builds them, as diffusers'
`GlmImagePipeline.generate_prior_tokens` does); size -> the sampling budget and constraint
(preview-grid codes, then large-grid codes, then EOS); generated ids -> the DiT's prior token
ids (large-grid codes upsampled 2x, nearest), equal to diffusers' post-processing.

Image-to-image (source images given) differs the way GLM-Image's processor and diffusers'
pipeline differ: the prompt holds each source image (`<image start><|image|><image end>`, the
placeholder expanded by vLLM from the image's grid) and one target grid only, so the AR writes
the large grid alone (no preview grid) before EOS. Source images are first fitted
(`fit_source_image`) so that both stages see the same pixels and the source grid, upsampled
2x, covers the DiT's condition latents exactly.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_omni_plugin.families.glm_image.positions import MAX_GRID_DIM, T2ILayout

# Pixels per AR token side; the DiT sees each AR token as 2x2 patches.
TOKEN_PIXELS = 32
# Key of SamplingParams.extra_args read by ImageGridLogitsProcessor.
GRID_EXTRA_ARG = "omni_image_grid"


def target_grids(height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(large grid, preview grid) in tokens (rows, cols) for a target size, as the processor."""
    if height <= 0 or width <= 0 or height % TOKEN_PIXELS or width % TOKEN_PIXELS:
        raise ValueError(
            f"GLM-Image needs height and width as positive multiples of {TOKEN_PIXELS}, "
            f"got {height}x{width}"
        )
    rows, cols = height // TOKEN_PIXELS, width // TOKEN_PIXELS
    ratio = rows / cols
    preview = (int(math.sqrt(ratio) * 16), int(math.sqrt(1 / ratio) * 16))
    for r, c in ((rows, cols), preview):
        if not (0 < r <= MAX_GRID_DIM and 0 < c <= MAX_GRID_DIM):
            raise ValueError(
                f"size {height}x{width} gives a {r}x{c} token grid; at most "
                f"{MAX_GRID_DIM} tokens per side ({MAX_GRID_DIM * TOKEN_PIXELS} px) are supported"
            )
    return (rows, cols), preview


def num_image_tokens(height: int, width: int, *, preview: bool = True) -> int:
    """Image codes the AR writes for a size: preview grid (text-to-image only) + large grid
    (EOS not counted)."""
    (rows, cols), (prows, pcols) = target_grids(height, width)
    return rows * cols + (prows * pcols if preview else 0)


@functools.lru_cache(maxsize=8)
def _load_processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def load_processor(processor_dir_or_obj: Any):
    if isinstance(processor_dir_or_obj, (str, Path)):
        return _load_processor(str(processor_dir_or_obj))
    return processor_dir_or_obj


def fit_source_image(image, min_pixels: int, max_pixels: int):
    """A source image resized (if needed) to sides that are multiples of TOKEN_PIXELS, within
    the image processor's pixel bounds (its `smart_resize` then keeps the scale: one vision
    token per 32x32 source pixels after its halving), as an RGB PIL image.

    Why: diffusers' pipeline hands the DiT the source at its own size (floored to 16) while the
    processor resizes it for the vision tokenizer; only when both agree does the upsampled
    source grid cover the condition latents. Raises ValueError for an aspect ratio over 4
    (the processor refuses those too).
    """
    from PIL import Image

    image = image.convert("RGB")
    width, height = image.size
    if max(width, height) > 4 * min(width, height):
        raise ValueError(f"source image {width}x{height}: aspect ratio must be at most 4")
    shortest, longest = round(math.sqrt(min_pixels)), round(math.sqrt(max_pixels))
    scale = 1.0
    if min(width, height) < shortest:
        scale = shortest / min(width, height)
    if max(width, height) * scale > longest:
        scale = longest / max(width, height)
    lo = max(TOKEN_PIXELS, -(-shortest // TOKEN_PIXELS) * TOKEN_PIXELS)
    hi = max(lo, longest // TOKEN_PIXELS * TOKEN_PIXELS)

    def side(x: int) -> int:
        return min(hi, max(lo, round(x * scale / TOKEN_PIXELS) * TOKEN_PIXELS))

    size = (side(width), side(height))
    if max(size) > 4 * min(size):
        raise ValueError(f"source image {width}x{height}: aspect ratio must be at most 4")
    if size == (width, height):
        return image
    return image.resize(size, Image.Resampling.BICUBIC)


def source_pixel_bounds(processor: Any) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a GLM-Image processor's image processor."""
    ip = processor.image_processor
    size = getattr(ip, "size", None) or {}
    lo = getattr(ip, "min_pixels", None) or size.get("shortest_edge")
    hi = getattr(ip, "max_pixels", None) or size.get("longest_edge")
    return int(lo), int(hi)


def collapse_placeholders(ids: Sequence[int], image_token_id: int) -> list[int]:
    """Each run of the image token -> one token (vLLM expands it again from the image grid)."""
    out: list[int] = []
    for tok in ids:
        if tok == image_token_id and out and out[-1] == image_token_id:
            continue
        out.append(tok)
    return out


def build_i2i_prompt(
    processor_dir_or_obj: Any, prompt: str, images: Sequence[Any], height: int, width: int
) -> list[int]:
    """Prompt token ids for image-to-image, one `<|image|>` per source image (not expanded).

    Built by GLM-Image's processor from the chat messages diffusers' pipeline builds (the
    images first, then the text), so everything but the placeholder runs is the processor's.
    `images` must be fitted (`fit_source_image`).
    """
    target_grids(height, width)
    processor = load_processor(processor_dir_or_obj)
    if not prompt:
        raise ValueError("prompt must not be empty")
    if not images:
        raise ValueError("image-to-image needs at least one source image")
    if processor.image_token in prompt:
        raise ValueError(f"the prompt must not contain the image token {processor.image_token!r}")
    content = [{"type": "image", "image": img} for img in images]
    content.append({"type": "text", "text": prompt})
    inputs = processor.apply_chat_template(
        [[{"role": "user", "content": content}]],
        tokenize=True,
        padding=False,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )
    return collapse_placeholders(inputs["input_ids"][0].tolist(), processor.image_token_id)


def build_t2i_prompt(processor_dir_or_obj: Any, prompt: str, height: int, width: int) -> list[int]:
    """Prompt token ids for text-to-image, built by GLM-Image's processor (chat template +
    `<sop>H W<eop><sop>h w<eop>` target grids + image-start token)."""
    target_grids(height, width)  # validate the size before tokenizing
    processor = load_processor(processor_dir_or_obj)
    if not prompt:
        raise ValueError("prompt must not be empty")
    if processor.image_token in prompt:
        raise ValueError(
            "image-to-image takes source images as images, not the image token "
            f"{processor.image_token!r} in the prompt"
        )
    messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
    inputs = processor.apply_chat_template(
        messages,
        tokenize=True,
        padding=False,
        target_h=height,
        target_w=width,
        return_dict=True,
        return_tensors="pt",
    )
    return inputs["input_ids"][0].tolist()


def _token_ids_of(model_config_or_dir: Any) -> tuple[int, int]:
    """(image_start_token_id, image_end_token_id) of a GLM-Image AR config.

    Accepts the `vision_language_encoder/` folder (or the pipeline root), a transformers
    GlmImageConfig, or a vLLM ModelConfig.
    """
    cfg = getattr(model_config_or_dir, "hf_config", model_config_or_dir)
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        if (path / "vision_language_encoder" / "config.json").exists():
            path = path / "vision_language_encoder"
        data = json.loads((path / "config.json").read_text())
        return int(data["image_start_token_id"]), int(data["image_end_token_id"])
    return int(cfg.image_start_token_id), int(cfg.image_end_token_id)


def t2i_sampling_overrides(
    model_config_or_dir: Any, height: int, width: int, *, preview: bool = True
) -> dict:
    """kwargs to merge into `vllm.SamplingParams` for one text-to-image request.

    Exactly `num_image_tokens` image codes, then EOS: ImageGridLogitsProcessor (installed with
    this package) masks every non-code id while codes are due and everything but EOS after, so
    random or unlucky weights can never hand the DiT an out-of-range id or a short grid.
    Temperature / top-p / seed stay the caller's. If the caller has its own `extra_args`,
    merge the dicts. `preview=False`: image-to-image (the large grid only).
    """
    image_start, image_end = _token_ids_of(model_config_or_dir)
    n = num_image_tokens(height, width, preview=preview)
    return {
        "max_tokens": n + 1,
        "min_tokens": n,
        "stop_token_ids": [image_end],
        "ignore_eos": False,
        "detokenize": False,
        "extra_args": {
            GRID_EXTRA_ARG: {
                "num_tokens": n,
                # Image codes are the ids below the image-start token.
                "num_codes": image_start,
                "eos_token_id": image_end,
            }
        },
    }


def tokens_to_prior_token_ids(
    generated_ids: Sequence[int] | torch.Tensor, height: int, width: int, *, preview: bool = True
) -> torch.LongTensor:
    """The DiT's prior token ids [1, 4 * rows * cols] from the AR's generated ids.

    Same as diffusers' `_extract_large_image_tokens` + `_upsample_token_ids`: skip the preview
    grid (text-to-image only), take the large grid, upsample 2x nearest.
    """
    (rows, cols), (prows, pcols) = target_grids(height, width)
    ids = torch.as_tensor(
        list(generated_ids) if not torch.is_tensor(generated_ids) else generated_ids
    )
    ids = ids.to(torch.long).flatten()
    start = prows * pcols if preview else 0
    if ids.numel() < start + rows * cols:
        raise ValueError(
            f"{ids.numel()} generated tokens, but {height}x{width} needs "
            f"{start + rows * cols} image codes (preview {prows}x{pcols} + {rows}x{cols})"
        )
    grid = ids[start : start + rows * cols].view(1, 1, rows, cols)
    up = torch.nn.functional.interpolate(grid.float(), scale_factor=2, mode="nearest")
    return up.to(torch.long).view(1, -1)


def parse_t2i_layout(
    token_ids: Sequence[int],
    *,
    grid_bos_id: int,
    grid_eos_id: int,
    image_start_id: int,
    decode: Callable[[list[int]], str],
    num_grids: int = 2,
) -> T2ILayout | None:
    """Read the target grids back from a prompt built by `build_t2i_prompt` (None: no grids).

    The prompt ends at the last image-start token; anything after it was generated (vLLM
    re-prefills a preempted request with its output). The last two `<sop>rows cols<eop>` pairs
    are (large, preview); decoding runs the last grid first, as transformers does.
    `num_grids=1`: image-to-image, whose prompt has the large grid only.
    """
    ids = list(token_ids)
    starts = [i for i, t in enumerate(ids) if t == image_start_id]
    if not starts:
        return None
    prompt = ids[: starts[-1] + 1]
    grids: list[tuple[int, int]] = []
    open_at = None
    for i, tok in enumerate(prompt):
        if tok == grid_bos_id:
            open_at = i
        elif tok == grid_eos_id and open_at is not None:
            parts = decode(prompt[open_at + 1 : i]).split()
            open_at = None
            if len(parts) == 2 and all(p.isdigit() for p in parts):
                grids.append((int(parts[0]), int(parts[1])))
    if not grids:
        return None
    return T2ILayout(prompt_len=len(prompt), grids=tuple(reversed(grids[-num_grids:])))


def source_positions(
    prompt_len: int, images: Sequence[tuple[int, int, int]]
) -> tuple[torch.Tensor, int]:
    """[3, prompt_len] positions of a prompt holding source images, and where the target grid
    starts, as transformers' `get_rope_index`: text tokens count on by one on all three axes;
    the image whose placeholder run starts at `offset` with a (rows, cols) grid gets
    (s, s + r, s + c) at row r, column c, and moves the count on by max(rows, cols).

    `images`: (offset, rows, cols) per source image, in prompt order.
    """
    t: list[int] = []
    h: list[int] = []
    w: list[int] = []
    pos = 0
    i = 0
    for offset, rows, cols in sorted(images):
        while i < min(offset, prompt_len):
            t.append(pos)
            h.append(pos)
            w.append(pos)
            pos += 1
            i += 1
        for r in range(rows):
            for c in range(cols):
                t.append(pos)
                h.append(pos + r)
                w.append(pos + c)
        i += rows * cols
        pos += max(rows, cols)
    while len(t) < prompt_len:
        t.append(pos)
        h.append(pos)
        w.append(pos)
        pos += 1
    out = torch.tensor([t[:prompt_len], h[:prompt_len], w[:prompt_len]], dtype=torch.long)
    return out, pos


def source_image_codes(
    visual: torch.nn.Module,
    vqmodel: torch.nn.Module,
    pixel_values: torch.Tensor,
    grid: torch.Tensor,
) -> list[torch.Tensor]:
    """Each source image's VQ codes (row-major over its grid), transformers'
    `get_image_features` + `get_image_tokens`: the vision encoder's patch features, reshaped to
    [1, hidden, rows, cols] per image, quantized by the VQ model."""
    grid = grid.to(torch.long).reshape(-1, 3).cpu()
    param = next(visual.parameters())
    hidden = visual(
        pixel_values.to(device=param.device, dtype=param.dtype),
        grid_thw=grid.to(param.device),
        return_dict=True,
    ).last_hidden_state
    out = []
    for emb, (t, h, w) in zip(hidden.split(grid.prod(-1).tolist()), grid.tolist(), strict=True):
        emb = emb.view(t, h, w, -1).permute(0, 3, 1, 2).reshape(-1, h, w)
        out.append(vqmodel.encode(emb[None]).image_tokens.reshape(-1))
    return out


def upsample_codes(codes: torch.Tensor, rows: int, cols: int) -> torch.LongTensor:
    """[1, 4 * rows * cols]: a grid of codes upsampled 2x (nearest), as diffusers'
    `_upsample_token_ids` does for the target and the source grids alike."""
    grid = codes.to(torch.long).reshape(1, 1, rows, cols).float()
    up = torch.nn.functional.interpolate(grid, scale_factor=2, mode="nearest")
    return up.to(torch.long).view(1, -1)


def load_vision_tokenizer(ar_dir: str | Path, device: Any = "cpu", dtype: Any = None):
    """(visual, vqmodel) of a GLM-Image AR checkpoint folder, as transformers defines them,
    with only their own tensors read from the safetensors shards (not the 9B text model)."""
    from safetensors import safe_open
    from transformers import GlmImageConfig
    from transformers.models.glm_image.modeling_glm_image import (
        GlmImageVisionModel,
        GlmImageVQVAE,
    )

    ar_dir = Path(ar_dir)
    config = GlmImageConfig.from_pretrained(ar_dir)
    config.vision_config._attn_implementation = "sdpa"
    visual = GlmImageVisionModel(config.vision_config).eval()
    vqmodel = GlmImageVQVAE(config.vq_config).eval()
    wanted = {"model.visual.": visual, "model.vqmodel.": vqmodel}
    states: dict[str, dict[str, torch.Tensor]] = {p: {} for p in wanted}
    for shard in sorted(ar_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                for prefix in wanted:
                    if name.startswith(prefix):
                        states[prefix][name[len(prefix) :]] = f.get_tensor(name)
    for prefix, module in wanted.items():
        missing, unexpected = module.load_state_dict(states[prefix], strict=False)
        missing = [m for m in missing if m in dict(module.named_parameters())]
        if missing or unexpected:
            raise RuntimeError(
                f"{ar_dir}: vision tokenizer weights {prefix}*: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        module.to(device=device, dtype=dtype)
    return visual, vqmodel
