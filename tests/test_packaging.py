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


# Modules that (un)pickle, or hand objects to pickle for you.
PICKLERS = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "multiprocessing.reduction"}


def pickle_uses(roots: list[Path]) -> list[str]:
    """Every import of a pickling module and every `pickle` name in code (comments and strings
    aside), in the shipped sources under `roots`; `testing/` builds test checkpoints only."""
    import ast

    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "testing" in path.relative_to(root).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names: list[str] = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [
                        f"{node.module}.{a.name}" for a in node.names if node.module
                    ]
                elif isinstance(node, ast.Name | ast.Attribute):
                    word = node.id if isinstance(node, ast.Name) else node.attr
                    names = [word] if "pickle" in word.lower() else []
                if any(n in PICKLERS or "pickle" in n.lower() for n in names):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_no_pickle_in_the_package():
    """No pickle in vllm_omni_plugin/ or entry_points/: every message is the typed schema of
    common/messages.py in msgpack, every payload a tensor, bytes or a registered struct."""
    uses = pickle_uses([ROOT / "vllm_omni_plugin", ROOT / "entry_points"])
    assert uses == [], "pickle is back:\n" + "\n".join(uses)


def test_the_pickle_check_can_fail(tmp_path):
    pkg = tmp_path / "vllm_omni_plugin"
    (pkg / "stages").mkdir(parents=True)
    (pkg / "stages" / "a.py").write_text("import pickle\n")
    (pkg / "stages" / "b.py").write_text("from multiprocessing.reduction import ForkingPickler\n")
    (pkg / "stages" / "c.py").write_text("def f(m):\n    return m.pickle_loads(b'')\n")
    (pkg / "stages" / "d.py").write_text("# a comment about pickle is fine\n")
    assert pickle_uses([pkg]) == [
        "vllm_omni_plugin/stages/a.py:1",
        "vllm_omni_plugin/stages/b.py:1",
        "vllm_omni_plugin/stages/c.py:2",
    ]
