"""Adapters keyed by diffusers pipeline class name, open to other packages.

Other packages add families through the entry-point group `vllm_omni_plugin.diffusion_adapters`:
the entry point's name is the pipeline class name (as in model_index.json's `_class_name`), its
value an adapter class (`pkg.module:MyAdapter`). Unknown classes fall back to the whole-pipeline
generic adapter.
"""

from __future__ import annotations

import importlib
import json
import logging
from importlib.metadata import entry_points
from pathlib import Path

from .base import DiffusionAdapter

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "vllm_omni_plugin.diffusion_adapters"
FALLBACK = "fallback"

# name -> "module:Class" (lazy, so importing the registry loads no model code) or the class.
_ADAPTERS: dict[str, str | type[DiffusionAdapter]] = {
    "GlmImagePipeline": "vllm_omni_plugin.diffusion.adapters.glm_image:GlmImageAdapter",
    "QwenImagePipeline": "vllm_omni_plugin.diffusion.adapters.qwen_image:QwenImageAdapter",
    "QwenImageEditPipeline": "vllm_omni_plugin.diffusion.adapters.qwen_image_edit:QwenImageEditAdapter",
    "QwenImageEditPlusPipeline": (
        "vllm_omni_plugin.diffusion.adapters.qwen_image_edit_plus:QwenImageEditPlusAdapter"
    ),
    "FluxPipeline": "vllm_omni_plugin.diffusion.adapters.flux:FluxAdapter",
    "FluxKontextPipeline": "vllm_omni_plugin.diffusion.adapters.flux_kontext:FluxKontextAdapter",
    "WanPipeline": "vllm_omni_plugin.diffusion.adapters.wan:WanAdapter",
    "ZImagePipeline": "vllm_omni_plugin.diffusion.adapters.z_image:ZImageAdapter",
    "Flux2KleinPipeline": "vllm_omni_plugin.diffusion.adapters.flux2_klein:Flux2KleinAdapter",
    "WanImageToVideoPipeline": "vllm_omni_plugin.diffusion.adapters.wan_i2v:WanImageToVideoAdapter",
    FALLBACK: "vllm_omni_plugin.diffusion.adapters.generic:GenericAdapter",
}
# Names older configs use for the same families (legacy `model_arch`).
_ALIASES = {
    "GlmImageForConditionalGeneration": "GlmImagePipeline",
    "GlmImageTransformer2DModel": "GlmImagePipeline",
    "QwenImageTransformer2DModel": "QwenImagePipeline",
    "FluxTransformer2DModel": "FluxPipeline",
    "WanTransformer3DModel": "WanPipeline",
}
_entry_points_loaded = False


def register_adapter(pipeline_class: str, adapter: str | type[DiffusionAdapter]) -> None:
    """Register (or replace) the adapter for a diffusers pipeline class name."""
    _ADAPTERS[pipeline_class] = adapter


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            _ADAPTERS[ep.name] = ep.load()
        except Exception:  # a broken third-party plugin must not take the engine down
            logger.exception("could not load diffusion adapter entry point %s", ep.name)


def registered_adapters() -> list[str]:
    _load_entry_points()
    return sorted(_ADAPTERS)


def _resolve(ref: str | type[DiffusionAdapter]) -> type[DiffusionAdapter]:
    if isinstance(ref, str):
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)
    return ref


def get_adapter_class(pipeline_class: str | None) -> type[DiffusionAdapter]:
    """Adapter for a pipeline class name; the generic fallback when none is registered."""
    _load_entry_points()
    name = _ALIASES.get(pipeline_class or "", pipeline_class or "")
    return _resolve(_ADAPTERS.get(name) or _ADAPTERS[FALLBACK])


def pipeline_class_of(model_dir: str | Path) -> str:
    """`_class_name` of a diffusers checkpoint folder."""
    index = Path(model_dir) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"{model_dir} has no model_index.json (not a diffusers pipeline)")
    return json.loads(index.read_text())["_class_name"]
