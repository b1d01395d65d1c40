"""Every subpackage ships: pyproject.toml lists packages explicitly (entry_points/ and
stage_configs/ are mapped into the package), and a folder missing from that list installs
nowhere but an editable checkout (vllm_omni_plugin.diffusion.parallel once failed the H200
run's DiT stage with ModuleNotFoundError)."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "vllm_omni_plugin").rglob("__init__.py")
    }
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages"
    assert {"vllm_omni_plugin.entry_points", "vllm_omni_plugin.stage_configs"} <= listed
