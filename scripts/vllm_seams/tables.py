"""The plugin's own tables of what it needs from vLLM: `SERVE_SEAMS` and the refused serve
flags in entry_points/patches.py, and the engine-field snapshots in
vllm_omni_plugin/config/vllm_engine_fields.py. Both modules import nothing of vLLM at module
level, so they are loaded here by path, without vLLM (and without the package's __init__).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _load_by_path(name: str, path: Path) -> ModuleType:
    """A project module that imports nothing of vLLM at module level, loaded without vLLM."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


patches = _load_by_path("_omni_seam_patches", ROOT / "entry_points" / "patches.py")
engine_fields_mod = _load_by_path(
    "_omni_seam_fields", ROOT / "vllm_omni_plugin" / "config" / "vllm_engine_fields.py"
)
