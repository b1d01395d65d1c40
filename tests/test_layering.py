"""Imports point inward (DESIGN.md): entry_points -> serving -> orchestrator -> stages -> the
engines, connectors and config. A lower layer never imports a higher one, not even lazily inside
a function; this reads every module's imports with `ast` (no import runs), so it costs nothing.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_omni_plugin"
# Higher number = outer layer. Folders not named here (diffusion, connectors, config, core,
# models, pipelines, testing) are the innermost layer.
RANK = {"serving": 3, "orchestrator": 2, "stages": 1}


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in one file of the package."""
    own = ["vllm_omni_plugin", *path.relative_to(PACKAGE).parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = own[: len(own) - (node.level - 1)]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
    return found


def test_no_module_imports_an_outer_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue  # package root modules (cli, __init__) sit outside the layers
        rank = RANK.get(parts[0], 0)
        for line, module in _imported_modules(path):
            if module.startswith("entry_points"):
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
                continue
            if not module.startswith("vllm_omni_plugin."):
                continue
            target = module.split(".")[1]
            if RANK.get(target, 0) > rank:
                upward.append(f"{path.relative_to(PACKAGE)}:{line} imports {module}")
    assert not upward, "imports that point outward:\n" + "\n".join(upward)


def test_the_check_sees_an_outward_import(tmp_path, monkeypatch):
    # The check must be able to fail: a stage module importing serving is caught.
    fake = tmp_path / "vllm_omni_plugin"
    (fake / "stages").mkdir(parents=True)
    (fake / "stages" / "bad.py").write_text("def f():\n    from ..serving.images import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    try:
        test_no_module_imports_an_outer_layer()
    except AssertionError as exc:
        assert "stages/bad.py:2 imports vllm_omni_plugin.serving.images" in str(exc)
    else:
        raise AssertionError("an outward import went unnoticed")
