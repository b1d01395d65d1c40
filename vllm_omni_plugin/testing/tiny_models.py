"""Tiny random-weight checkpoints in the hub layouts, for tests (no model hub is reachable here).

`build_tiny_model(kind, out_dir, seed)` writes one folder that loads with
`DiffusionPipeline.from_pretrained(out_dir)` (GLM-Image: `GlmImagePipeline`) exactly like the
real checkpoint, and produces a 64x64 image in seconds on a CPU. Same seed -> byte-identical
weight files; each family's module documents its sizes and id layout.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# The one table of model kinds: kind -> module with `build(out_dir: Path, seed: int) -> Path`.
# `build_tiny_model` and the console script (`vllm-omni-plugin make-tiny-model KIND DIR`) both
# read it: adding a kind is adding its line here.
_BUILDERS = {
    "glm-image": "vllm_omni_plugin.testing.tiny_glm_image",
    "qwen-image": "vllm_omni_plugin.testing.tiny_qwen_image",
    "qwen-image-edit": "vllm_omni_plugin.testing.tiny_qwen_image_edit",
    "flux": "vllm_omni_plugin.testing.tiny_flux",
    "flux-kontext": "vllm_omni_plugin.testing.tiny_flux_kontext",
    "qwen-image-edit-plus": "vllm_omni_plugin.testing.tiny_qwen_image_edit_plus",
    "wan": "vllm_omni_plugin.testing.tiny_wan",  # Wan2.2 text-to-video (WanPipeline)
    "z-image": "vllm_omni_plugin.testing.tiny_z_image",  # Z-Image-Turbo (ZImagePipeline)
    "flux2-klein": "vllm_omni_plugin.testing.tiny_flux2_klein",  # FLUX.2 klein (t2i + edits)
    "wan-ti2v": "vllm_omni_plugin.testing.tiny_wan_ti2v",  # Wan2.2 TI2V-5B (text/image to video)
    "wan-i2v": "vllm_omni_plugin.testing.tiny_wan_i2v",  # Wan2.2 I2V-A14B (two experts)
    # Qwen3-Omni (thinker + talker + Code2Wav; config.json at the top, no model_index.json)
    "qwen3-omni": "vllm_omni_plugin.testing.tiny_qwen3_omni",
}

KINDS = tuple(_BUILDERS)


# kind -> module with `build(out_dir, seed, num_layers=None)` ("module:function" names another
# function of that signature): the published sizes.
_FULL_BUILDERS = {
    "glm-image": "vllm_omni_plugin.testing.full_glm_image",
    "qwen3-omni": "vllm_omni_plugin.testing.full_qwen3_omni",
    "qwen-image": "vllm_omni_plugin.testing.full_qwen_image",
    "flux": "vllm_omni_plugin.testing.full_flux",
    "wan-ti2v": "vllm_omni_plugin.testing.full_wan",  # Wan2.2 TI2V-5B
    "wan": "vllm_omni_plugin.testing.full_wan:build_t2v_a14b",  # Wan2.2 T2V-A14B
}
FULL_KINDS = tuple(_FULL_BUILDERS)

SIZES = ("tiny", "full")


def build_tiny_model(
    kind: str,
    out_dir: str | Path,
    seed: int = 0,
    size: str = "tiny",
    num_layers: int | None = None,
) -> Path:
    """Write a `kind` checkpoint (one of KINDS) to `out_dir`; return its path.

    `size="full"` (FULL_KINDS only) writes the published model sizes with random bf16 weights,
    on the GPU when there is one; `num_layers` then overrides every stack's depth (for tests).
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(KINDS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(SIZES)}")
    if size == "full" and kind not in _FULL_BUILDERS:
        raise ValueError(
            f"--size full is available for {', '.join(_FULL_BUILDERS)} only, not {kind!r}"
        )
    if num_layers is not None and size != "full":
        raise ValueError("num_layers applies to --size full only")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if size == "full":
        module_name, _, function = _FULL_BUILDERS[kind].partition(":")
        builder = getattr(importlib.import_module(module_name), function or "build")
        path = Path(builder(out, seed, num_layers=num_layers))
    else:
        module = importlib.import_module(_BUILDERS[kind])
        path = Path(module.build(out, seed))
        if (path / "model_index.json").exists():
            _normalize_model_index(path / "model_index.json")
    logger.info("wrote %s %s checkpoint (seed %d) to %s", size, kind, seed, path)
    return path


def _normalize_model_index(index_file: Path) -> None:
    """Name transformers components' library "transformers", as the hub's model_index.json does.

    diffusers' save_pretrained writes the transformers sub-module instead (e.g. "glm_image" for
    GlmImageProcessor); both load, but the hub files say "transformers".
    """
    index = json.loads(index_file.read_text())
    for key, value in index.items():
        if isinstance(value, list) and len(value) == 2 and value[0] not in ("diffusers", None):
            import transformers

            if hasattr(transformers, value[1]):
                index[key] = ["transformers", value[1]]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
