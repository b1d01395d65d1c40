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

# kind -> module with `build(out_dir: Path, seed: int) -> Path`
_BUILDERS = {
    "glm-image": "vllm_omni_plugin.testing.tiny_glm_image",
    "qwen-image": "vllm_omni_plugin.testing.tiny_qwen_image",
    "flux": "vllm_omni_plugin.testing.tiny_flux",
}

KINDS = tuple(_BUILDERS)


def build_tiny_model(kind: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny `kind` checkpoint (glm-image | qwen-image | flux) to `out_dir`; return its path."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {', '.join(KINDS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = importlib.import_module(_BUILDERS[kind])
    path = Path(module.build(out, seed))
    _normalize_model_index(path / "model_index.json")
    logger.info("wrote tiny %s checkpoint (seed %d) to %s", kind, seed, path)
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
