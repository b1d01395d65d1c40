"""Imports point inward, one named step at a time; this reads every module's imports with `ast`
(no import runs), lazy imports inside functions included, so it costs nothing.

The layers, outermost first (entry_points/ and the package's root modules, cli.py, sit outside
them; nothing in the package imports entry_points):

    serving       the OpenAI-compatible routes; talks to the orchestrator only
    orchestrator  stage handles, supervision, the node link, the backend choice
    stages        the stage processes: each drives one engine
    diffusion | models | core | connectors   the engines (ours; vLLM's model and scheduler
                  parts) and the payload transports: independent of each other
    code2wav      the torch engine a stage drives (Qwen3-Omni's Code2Wav)
    config        the typed deploy config
    pipelines     the frozen topologies (stage graphs)
    families      what one model family's engines share (GLM-Image's processing)
    common        the leaf: the message schema, payload descriptors, limits, errors, media types
    testing       test checkpoint builders, used by the console script only

MAY_IMPORT lists each package's direct dependencies. Every one points to a lower rank, and an
import outside the list fails: an outward one (stages -> serving), a skip-level one (serving ->
diffusion: the API server never loads an engine) or a sideways one (diffusion -> models).

Inside a layer, modules import one another without a circle, `if TYPE_CHECKING:` imports
included (a type a lower module needs of a higher one is a Protocol in the lower one). And no
module names another layer's class by a "vllm_omni_plugin.pkg.module:Class" string, an edge
this check could not see (stages/loops.py maps stage loops to their classes by import).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_omni_plugin"
# Higher number = outer layer.
RANK = {
    "testing": 9,
    "serving": 8,
    "orchestrator": 7,
    "stages": 6,
    "diffusion": 5,
    "models": 5,
    "core": 5,
    "connectors": 5,
    "code2wav": 4,
    "config": 3,
    "pipelines": 2,
    "families": 1,
    "common": 0,
}
MAY_IMPORT = {
    "testing": set(),
    "serving": {"orchestrator", "config", "pipelines", "common"},
    "orchestrator": {"stages", "connectors", "config", "pipelines", "common"},
    "stages": {
        "diffusion",
        "models",
        "code2wav",
        "connectors",
        "config",
        "pipelines",
        "families",
        "common",
    },
    "diffusion": {"families", "common"},
    "models": {"config", "families", "common"},
    "code2wav": {"config", "families", "common"},
    "core": {"config", "common"},
    "connectors": {"common"},
    "config": {"pipelines", "families", "common"},
    "pipelines": {"families", "common"},
    "families": {"common"},
    "common": set(),
}


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


def test_the_layer_table_points_inward():
    assert set(MAY_IMPORT) == set(RANK)
    for pkg, deps in MAY_IMPORT.items():
        assert all(RANK[d] < RANK[pkg] for d in deps), (pkg, deps)


def test_every_package_has_a_layer():
    on_disk = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert on_disk - {"entry_points", "stage_configs"} <= set(RANK), "give it a layer"


def test_no_module_imports_outside_its_layer():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2:
            continue  # package root modules (cli, __init__) sit outside the layers
        own = parts[0]
        for line, module in _imported_modules(path):
            where = f"{path.relative_to(PACKAGE)}:{line} imports {module}"
            if module.startswith("entry_points") or module.startswith(
                "vllm_omni_plugin.entry_points"
            ):
                wrong.append(where)
                continue
            if not module.startswith("vllm_omni_plugin."):
                continue
            target = module.split(".")[1]
            if target != own and target not in MAY_IMPORT.get(own, set()):
                wrong.append(where)
    assert not wrong, "imports outside the layers (see the module doc):\n" + "\n".join(wrong)


def test_the_check_sees_outward_skip_level_and_sideways_imports(tmp_path, monkeypatch):
    # The check must be able to fail: a stage importing serving (outward), serving importing
    # the diffusion engine (skip-level) and diffusion importing models (sideways) are caught.
    fake = tmp_path / "vllm_omni_plugin"
    bad = {
        "stages": "def f():\n    from ..serving.images import x\n",
        "serving": "from vllm_omni_plugin.diffusion.engine import DiffusionEngine\n",
        "diffusion": "import vllm_omni_plugin.models.glm_image\n",
        "common": "from ..config import StageConfig\n",
    }
    for pkg, text in bad.items():
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "bad.py").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    try:
        test_no_module_imports_outside_its_layer()
    except AssertionError as exc:
        found = str(exc)
    else:
        raise AssertionError("an import outside the layers went unnoticed")
    assert "stages/bad.py:2 imports vllm_omni_plugin.serving.images" in found
    assert "serving/bad.py:1 imports vllm_omni_plugin.diffusion.engine" in found
    assert "diffusion/bad.py:1 imports vllm_omni_plugin.models.glm_image" in found
    assert "common/bad.py:1 imports vllm_omni_plugin.config" in found


def test_serving_loads_no_engine():
    """Importing every serving module (what the API server loads) pulls in no engine, no stage
    code and no torch: the API server validates and routes, the stages compute."""
    import subprocess

    code = (
        "import importlib, pkgutil, sys\n"
        "import vllm_omni_plugin.serving as s\n"
        "for m in pkgutil.iter_modules(s.__path__):\n"
        "    importlib.import_module('vllm_omni_plugin.serving.' + m.name)\n"
        "heavy = ('torch', 'diffusers', 'transformers') + tuple(\n"
        "    'vllm_omni_plugin.' + p for p in ('diffusion', 'models', 'stages', 'connectors'))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (`from . import x` of a submodule x: x)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        own = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(own[: len(own) - (node.level - 1)] + [node.module or ""])
                    base = base.rstrip(".")
                else:
                    base = node.module or ""
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in files else base)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    cycles = _cycles(_import_graph())
    assert not cycles, "modules that import one another (type-only imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_sees_a_type_only_circle(tmp_path, monkeypatch):
    fake = tmp_path / "vllm_omni_plugin"
    (fake / "stages").mkdir(parents=True)
    (fake / "stages" / "__init__.py").write_text("")
    (fake / "stages" / "a.py").write_text("from .b import B\n")
    (fake / "stages" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
    )
    (fake / "stages" / "c.py").write_text("from . import a\n")  # into the circle, not on it
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _cycles(_import_graph()) == [["vllm_omni_plugin.stages.a", "vllm_omni_plugin.stages.b"]]


_CLASS_BY_STRING = re.compile(r"vllm_omni_plugin((?:\.\w+)+):\w+")
# Names handed to vLLM, not resolved by us: its model registry and its `logits_processors`
# engine argument take "module:Class" and import it in the engine's process, so registering
# the plugin (every vLLM process does) loads no model code.
_FOR_VLLM = {
    "vllm_omni_plugin.models.glm_image.model:GlmImageForConditionalGeneration",
    "vllm_omni_plugin.models.glm_image.logits:ImageGridLogitsProcessor",
    "vllm_omni_plugin.models.qwen3_omni.talker:Qwen3OmniTalkerForCodecGeneration",
}


def test_no_class_of_another_layer_named_by_string():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for match in _CLASS_BY_STRING.finditer(node.value):
                    if match.group(0) in _FOR_VLLM:
                        continue
                    if len(parts) < 2 or match.group(1).split(".")[1] != parts[0]:
                        wrong.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {match.group(0)}")
    assert not wrong, "import these instead (see the module doc):\n" + "\n".join(wrong)
