"""Load a diffusers pipeline's components from the standard checkpoint layout."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from ..errors import DiffusionEngineError

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def load_pipeline(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, skip: tuple[str, ...] = ()
) -> Any:
    """`DiffusionPipeline.from_pretrained` with components in `skip` left unloaded.

    diffusers resolves each subfolder's class from model_index.json, so real checkpoints and
    tiny test ones go through the same code. Skipped components (e.g. GLM-Image's 9B AR model,
    which runs in the AR stage) are never read from disk.
    """
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(
        str(model_dir), dtype=dtype, **{name: None for name in skip}
    )
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def configure_vae(pipe: Any, slicing: bool | None, tiling: bool | None) -> None:
    """vae_use_slicing / vae_use_tiling: switch the VAE's own decode modes (None: its default).

    The adapters call `vae.decode` directly, which honours both modes in diffusers' VAEs.
    """
    vae = getattr(pipe, "vae", None)
    for name, value, on, off in (
        ("vae_use_slicing", slicing, "enable_slicing", "disable_slicing"),
        ("vae_use_tiling", tiling, "enable_tiling", "disable_tiling"),
    ):
        if value is None:
            continue
        method = getattr(vae, on if value else off, None)
        if method is None:
            raise DiffusionEngineError(
                f"{name}={value}: the VAE of this pipeline ({type(vae).__name__}) has no {on}"
            )
        method()
