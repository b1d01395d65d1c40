"""GLM-Image text-to-image request preparation and output post-processing for the AR stage.

prompt + size -> prompt token ids (GLM-Image's own processor builds them, as diffusers'
`GlmImagePipeline.generate_prior_tokens` does); size -> the sampling budget and constraint
(preview-grid codes, then large-grid codes, then EOS); generated ids -> the DiT's prior token
ids (large-grid codes upsampled 2x, nearest), equal to diffusers' post-processing.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_omni_plugin.models.glm_image.positions import MAX_GRID_DIM, T2ILayout

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


def num_image_tokens(height: int, width: int) -> int:
    """Image codes the AR writes for a size: preview grid + large grid (EOS not counted)."""
    (rows, cols), (prows, pcols) = target_grids(height, width)
    return rows * cols + prows * pcols


@functools.lru_cache(maxsize=8)
def _load_processor(path: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def build_t2i_prompt(processor_dir_or_obj: Any, prompt: str, height: int, width: int) -> list[int]:
    """Prompt token ids for text-to-image, built by GLM-Image's processor (chat template +
    `<sop>H W<eop><sop>h w<eop>` target grids + image-start token)."""
    target_grids(height, width)  # validate the size before tokenizing
    processor = processor_dir_or_obj
    if isinstance(processor, (str, Path)):
        processor = _load_processor(str(processor))
    if not prompt:
        raise ValueError("prompt must not be empty")
    if processor.image_token in prompt:
        raise ValueError(
            "image-to-image is not supported yet: the prompt contains the image token "
            f"{processor.image_token!r}"
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


def t2i_sampling_overrides(model_config_or_dir: Any, height: int, width: int) -> dict:
    """kwargs to merge into `vllm.SamplingParams` for one text-to-image request.

    Exactly `num_image_tokens` image codes, then EOS: ImageGridLogitsProcessor (installed with
    this package) masks every non-code id while codes are due and everything but EOS after, so
    random or unlucky weights can never hand the DiT an out-of-range id or a short grid.
    Temperature / top-p / seed stay the caller's. If the caller has its own `extra_args`,
    merge the dicts.
    """
    image_start, image_end = _token_ids_of(model_config_or_dir)
    n = num_image_tokens(height, width)
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
    generated_ids: Sequence[int] | torch.Tensor, height: int, width: int
) -> torch.LongTensor:
    """The DiT's prior token ids [1, 4 * rows * cols] from the AR's generated ids.

    Same as diffusers' `_extract_large_image_tokens` + `_upsample_token_ids`: skip the preview
    grid, take the large grid, upsample 2x nearest.
    """
    (rows, cols), (prows, pcols) = target_grids(height, width)
    ids = torch.as_tensor(
        list(generated_ids) if not torch.is_tensor(generated_ids) else generated_ids
    )
    ids = ids.to(torch.long).flatten()
    start = prows * pcols
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
) -> T2ILayout | None:
    """Read the target grids back from a prompt built by `build_t2i_prompt` (None: no grids).

    The prompt ends at the last image-start token; anything after it was generated (vLLM
    re-prefills a preempted request with its output). The last two `<sop>rows cols<eop>` pairs
    are (large, preview); decoding runs the last grid first, as transformers does.
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
    return T2ILayout(prompt_len=len(prompt), grids=tuple(reversed(grids[-2:])))
