#!/usr/bin/env python3
"""Check that a vLLM release still has every seam vllm-omni-plugin relies on.

    python scripts/check_vllm_seams.py SOURCE [SOURCE ...]

SOURCE is a vLLM wheel (read with zipfile, nothing installed) or a directory that holds the
`vllm` package (e.g. a venv's site-packages). The sources are read with `ast`; nothing of
vLLM is imported, so any minor can be checked on any machine. What is checked, for the minor
the source declares (its dist-info or vllm/_version.py):

* the minor is inside the window (`SERVE_SEAMS` in entry_points/patches.py, and the engine-field
  table in vllm_omni_plugin/config/vllm_engine_fields.py);
* every `from vllm... import X` / `import vllm...` in the project resolves to a module and a
  name defined there (following re-exports and vLLM's lazy `MODULE_ATTRS`);
* every call from project code to a vLLM function or class uses keyword names the callee
  accepts;
* every project class that subclasses a vLLM class: methods it (or its project mixins) defines
  that vLLM also defines are overrides with the same parameter names, the others do not
  collide, and vLLM's abstract methods are implemented;
* the serve seams of that minor's `SERVE_SEAMS` row: the API-server module, the patched
  functions and their signatures, that their callers look the patched names up as module
  globals, the endpoint-plugin attach/state hooks and interface, `load_endpoint_plugins`;
* the CLI seams: `AsyncEngineArgs.add_cli_args` -> `load_general_plugins()` and
  `EngineArgs.add_cli_args`; `vllm serve`'s `cmd` -> `run_headless`, `validate` ->
  `validate_parsed_serve_args`; the dests of the multi-API-server / data-parallel flags we refuse;
* plugin groups, `ModelRegistry.register_model` / `get_supported_archs`,
  `KVConnectorFactory.register_connector` / `_registry`, `SchedulerConfig` fields;
* the worker process title (`VLLM_PROCESS_NAME_PREFIX` + "::" + "Worker");
* `Worker.determine_available_memory` returns early, before its free-memory profiling, when
  `kv_cache_memory_bytes` is set (stages sharing a GPU start together on that, orchestrator.py);
* `engine_fields(minor)` equals the wheel's EngineArgs/AsyncEngineArgs fields, both ways, with
  matching coarse types where the annotation is a plain type.

Exit status 0 when everything is found, 1 otherwise (each problem printed on its own line).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PROJECT_DIRS = ("vllm_omni_plugin", "entry_points")


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


# ------------------------------------------------------------------------------------------
# vLLM sources (wheel or directory)
# ------------------------------------------------------------------------------------------


class Source:
    """vLLM's sources in a wheel or a directory; `overrides` replaces files by their path in
    the package (e.g. "vllm/envs.py"; None deletes one), which is how the tests move a seam."""

    def __init__(self, path: Path, overrides: dict[str, str | None] | None = None):
        self.path = path
        self.overrides = dict(overrides or {})
        self._zip = zipfile.ZipFile(path) if path.is_file() else None
        self._names = set(self._zip.namelist()) if self._zip else None
        self._ast: dict[str, ast.Module | None] = {}
        self.version = self._read_version()
        self.minor = patches.vllm_minor(self.version)

    def read(self, rel: str) -> str | None:
        if rel in self.overrides:
            return self.overrides[rel]
        if self._zip is not None:
            if rel not in self._names:
                return None
            return self._zip.read(rel).decode("utf-8")
        file = self.path / rel
        return file.read_text(encoding="utf-8") if file.is_file() else None

    def _read_version(self) -> str:
        """The version the package itself declares (vllm/_version.py, written at build time),
        else its dist-info METADATA."""
        text = self.read("vllm/_version.py") or ""
        m = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", text, re.M)
        if m:
            return m.group(1)
        if self._names is not None:
            metas = [n for n in self._names if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", n)]
        else:
            metas = [
                str(p.relative_to(self.path)) for p in self.path.glob("vllm-*.dist-info/METADATA")
            ]
        for meta in sorted(metas):
            m = re.search(r"^Version: (\S+)", self.read(meta) or "", re.M)
            if m:
                return m.group(1)
        raise SystemExit(f"{self.path}: cannot tell which vLLM version this is")

    def module_file(self, dotted: str) -> str | None:
        rel = dotted.replace(".", "/")
        for cand in (f"{rel}.py", f"{rel}/__init__.py"):
            if self.read(cand) is not None:
                return cand
        return None

    def is_package(self, dotted: str) -> bool:
        return self.read(dotted.replace(".", "/") + "/__init__.py") is not None

    def module(self, dotted: str) -> ast.Module | None:
        if dotted not in self._ast:
            rel = self.module_file(dotted)
            self._ast[dotted] = ast.parse(self.read(rel) or "", rel) if rel else None
        return self._ast[dotted]


# ------------------------------------------------------------------------------------------
# AST helpers
# ------------------------------------------------------------------------------------------

Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements at module level, including those inside if/try/with blocks."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _module_level(block)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def top_names(tree: ast.Module) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in _module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node  # the last definition wins (after @overload stubs)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out.setdefault((alias.asname or alias.name).split(".")[0], node)
    return out


def _absolute(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@dataclass
class Found:
    module: str
    node: ast.AST | None  # None: the name is a submodule


def resolve(src: Source, module: str, name: str, depth: int = 0) -> Found | None:
    """Where `from module import name` ends up in vLLM's sources, or None."""
    if depth > 8:
        return None
    tree = src.module(module)
    if tree is None:
        return None
    node = top_names(tree).get(name)
    if isinstance(node, ast.ImportFrom):
        target = _absolute(module, node, src.is_package(module))
        for alias in node.names:
            if (alias.asname or alias.name) == name:
                if src.module(f"{target}.{alias.name}") is not None:
                    return Found(f"{target}.{alias.name}", None)
                return resolve(src, target, alias.name, depth + 1)
    if isinstance(node, ast.Import):
        return Found(module, node)
    if node is not None:
        return Found(module, node)
    if src.module(f"{module}.{name}") is not None:
        return Found(f"{module}.{name}", None)
    for stmt in _module_level(tree.body):  # `from .x import *`
        if isinstance(stmt, ast.ImportFrom) and any(a.name == "*" for a in stmt.names):
            found = resolve(src, _absolute(module, stmt, src.is_package(module)), name, depth + 1)
            if found is not None:
                return found
    # vLLM's lazy top-level names: MODULE_ATTRS = {"Name": ".mod:Name"} + __getattr__.
    if "__getattr__" in top_names(tree):
        for stmt in _module_level(tree.body):
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict):
                for key, value in zip(stmt.value.keys, stmt.value.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == name:
                        if isinstance(value, ast.Constant) and isinstance(value.value, str):
                            ref = value.value
                            mod, _, attr = ref.partition(":")
                            if mod.startswith("."):
                                mod = module + mod if src.is_package(module) else mod
                            return resolve(src, mod, attr or name, depth + 1)
    return None


def resolve_def(src: Source, module: str, name: str) -> tuple[str, Def] | None:
    found = resolve(src, module, name)
    if found and isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return found.module, found.node
    return None


def class_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


@dataclass
class Params:
    positional: list[str]
    kwonly: list[str]
    varargs: bool
    varkw: bool
    required_positional: list[str] = field(default_factory=list)
    required_kwonly: list[str] = field(default_factory=list)

    @property
    def names(self) -> set[str]:
        return set(self.positional) | set(self.kwonly)


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_first: bool = False) -> Params:
    a = fn.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    required = positional[: len(positional) - len(a.defaults)]
    if drop_first and positional:
        positional, required = positional[1:], required[1:]
    kwonly = [p.arg for p in a.kwonlyargs]
    required_kw = [k for k, d in zip(kwonly, a.kw_defaults, strict=True) if d is None]
    return Params(
        positional, kwonly, a.vararg is not None, a.kwarg is not None, required, required_kw
    )


def _decorators(fn: ast.AST) -> set[str]:
    out = set()
    for d in getattr(fn, "decorator_list", []):
        node = d.func if isinstance(d, ast.Call) else d
        out.add(node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", ""))
    return out


def _locals(fn: ast.AST) -> set[str]:
    names = {p.arg for p in ast.walk(fn.args) if isinstance(p, ast.arg)}  # type: ignore[attr-defined]
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def calls_global(fn: ast.AST, name: str) -> bool:
    """`fn` calls `name` by its module-global name (not a local or a parameter)."""
    if name in _locals(fn):
        return False
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
        for n in ast.walk(fn)
    )


def calls_attr(fn: ast.AST, attr: str, on: str | None = None) -> bool:
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr:
            if on is None or (isinstance(n.func.value, ast.Name) and n.func.value.id == on):
                return True
    return False


def imports_in_body(fn: ast.AST, module: str, name: str) -> bool:
    return any(
        isinstance(n, ast.ImportFrom)
        and n.module == module
        and not n.level
        and any(a.name == name for a in n.names)
        for n in ast.walk(fn)
    )


def string_constants(tree: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def class_fields(cls: ast.ClassDef) -> dict[str, ast.expr]:
    return {
        n.target.id: n.annotation
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def coarse_type(annotation: ast.expr) -> str:
    """bool/int/float/str/list/dict for a plain annotation (optionally `| None`), else any."""
    text = ast.unparse(annotation)
    parts = [p.strip() for p in re.split(r"\|(?![^\[]*\])", text) if p.strip() != "None"]
    if len(parts) != 1:
        return "any"
    part = parts[0]
    if part in ("bool", "int", "float", "str"):
        return part
    if part == "list" or part.startswith("list["):
        return "list"
    if part == "dict" or part.startswith("dict["):
        return "dict"
    return "any"


# ------------------------------------------------------------------------------------------
# Project sources
# ------------------------------------------------------------------------------------------


@dataclass
class ProjectFile:
    path: Path
    dotted: str
    tree: ast.Module
    vllm_names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local -> (mod, name)


def project_files() -> list[ProjectFile]:
    out = []
    for top in PROJECT_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[0] == "entry_points":
                parts = ["vllm_omni_plugin", *parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append(ProjectFile(path, ".".join(parts), ast.parse(path.read_text(), str(path))))
    return out


def _guarded_by_import_error(tree: ast.Module) -> set[int]:
    """Line numbers of imports inside `try: ... except ImportError` (optional imports)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers
        ):
            for stmt in node.body:
                lines.update(n.lineno for n in ast.walk(stmt) if isinstance(n, ast.ImportFrom))
    return lines


# ------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------


class Report:
    def __init__(self, src: Source):
        self.src = src
        self.problems: list[str] = []
        self.checked = 0

    def check(self, ok: bool, what: str) -> bool:
        self.checked += 1
        if not ok:
            self.problems.append(what)
        return ok


def check_window(r: Report) -> None:
    r.check(
        r.src.minor in patches.SERVE_SEAMS,
        f"vLLM {r.src.version}: minor {r.src.minor} is not in entry_points/patches.py SERVE_SEAMS",
    )
    r.check(
        r.src.minor in engine_fields_mod.SUPPORTED_MINORS,
        f"vLLM {r.src.version}: minor {r.src.minor} has no engine-field table in "
        "config/vllm_engine_fields.py",
    )


def check_project_imports(r: Report, files: list[ProjectFile]) -> None:
    src = r.src
    for pf in files:
        optional = _guarded_by_import_error(pf.tree)
        for node in ast.walk(pf.tree):
            where = f"{pf.path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                if node.module != "vllm" and not node.module.startswith("vllm."):
                    continue
                if node.lineno in optional:
                    continue
                if not r.check(
                    src.module(node.module) is not None, f"{where}: no module {node.module}"
                ):
                    continue
                for alias in node.names:
                    found = resolve(src, node.module, alias.name)
                    if r.check(found is not None, f"{where}: {node.module} has no {alias.name}"):
                        pf.vllm_names[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "vllm" or alias.name.startswith("vllm."):
                        r.check(
                            src.module(alias.name) is not None, f"{where}: no module {alias.name}"
                        )


def _callee_params(src: Source, module: str, name: str) -> tuple[str, Params] | None:
    found = resolve_def(src, module, name)
    if found is None:
        return None
    mod, node = found
    if isinstance(node, ast.ClassDef):
        init = _find_in_mro(src, mod, node, "__init__")
        if init is None:
            return None
        return f"{mod}.{node.name}.__init__", params(init[1], drop_first=True)
    return f"{mod}.{node.name}", params(node)


def check_project_calls(r: Report, files: list[ProjectFile]) -> None:
    for pf in files:
        for node in ast.walk(pf.tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            ref = pf.vllm_names.get(node.func.id)
            if ref is None:
                continue
            callee = _callee_params(r.src, *ref)
            if callee is None:
                continue
            qual, p = callee
            where = f"{pf.path.relative_to(ROOT)}:{node.lineno}"
            if not p.varkw:
                for kw in node.keywords:
                    if kw.arg is not None:
                        r.check(kw.arg in p.names, f"{where}: {qual} takes no argument {kw.arg!r}")
            if not p.varargs and not any(isinstance(a, ast.Starred) for a in node.args):
                r.check(
                    len(node.args) <= len(p.positional),
                    f"{where}: {qual} takes {len(p.positional)} positional arguments, "
                    f"called with {len(node.args)}",
                )


def _class_bases(src: Source, module: str, cls: ast.ClassDef) -> list[tuple[str, ast.ClassDef]]:
    out = []
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else None
        if name is None:
            continue
        found = resolve_def(src, module, name)
        if found and isinstance(found[1], ast.ClassDef):
            out.append((found[0], found[1]))
    return out


def _mro(
    src: Source, module: str, cls: ast.ClassDef, depth: int = 0
) -> list[tuple[str, ast.ClassDef]]:
    out = [(module, cls)]
    if depth < 10:
        for mod, base in _class_bases(src, module, cls):
            out.extend(_mro(src, mod, base, depth + 1))
    return out


def _find_in_mro(src: Source, module: str, cls: ast.ClassDef, name: str):
    for mod, c in _mro(src, module, cls):
        m = class_method(c, name)
        if m is not None:
            return f"{mod}.{c.name}", m
    return None


def check_project_subclasses(r: Report, files: list[ProjectFile]) -> None:
    src = r.src
    by_name = {
        (pf.dotted, n.name): (pf, n)
        for pf in files
        for n in pf.tree.body
        if isinstance(n, ast.ClassDef)
    }
    for pf in files:
        for cls in (n for n in pf.tree.body if isinstance(n, ast.ClassDef)):
            ours: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
            vllm_bases: list[tuple[str, ast.ClassDef]] = []
            stack = [(pf, cls)]
            while stack:
                f, c = stack.pop()
                for item in c.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        ours.setdefault(item.name, item)
                for base in c.bases:
                    if not isinstance(base, ast.Name):
                        continue
                    if base.id in f.vllm_names:
                        found = resolve_def(src, *f.vllm_names[base.id])
                        if found and isinstance(found[1], ast.ClassDef):
                            vllm_bases.append((found[0], found[1]))
                        continue
                    local = by_name.get((f.dotted, base.id))
                    if local is None:  # imported from another project module
                        for stmt in f.tree.body:
                            if (
                                isinstance(stmt, ast.ImportFrom)
                                and stmt.module
                                and stmt.module.startswith("vllm_omni_plugin")
                            ):
                                if any((a.asname or a.name) == base.id for a in stmt.names):
                                    local = by_name.get((stmt.module, base.id))
                    if local is not None:
                        stack.append(local)
            if not vllm_bases:
                continue
            where = f"{pf.path.relative_to(ROOT)}: {cls.name}"
            vllm_methods: dict[str, tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
            abstract: dict[str, str] = {}
            for bmod, bcls in vllm_bases:
                for mod, c in _mro(src, bmod, bcls):
                    for item in c.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            vllm_methods.setdefault(item.name, (f"{mod}.{c.name}", item))
                            if "abstractmethod" in _decorators(item):
                                abstract.setdefault(item.name, f"{mod}.{c.name}")
            for name, fn in ours.items():
                if name not in vllm_methods:
                    continue
                qual, theirs = vllm_methods[name]
                if name.startswith("__") and name != "__init__":
                    continue
                mine, them = params(fn, drop_first=True), params(theirs, drop_first=True)
                if mine.varargs and mine.varkw:
                    continue
                # Callers use vLLM's signature: ours must take its required parameters, by name
                # and in order (or through *args / **kwargs).
                positional_ok = mine.varargs or (
                    mine.positional[: len(them.required_positional)] == them.required_positional
                )
                keywords_ok = mine.varkw or set(them.required_kwonly) <= mine.names
                r.check(
                    positional_ok and keywords_ok,
                    f"{where}.{name}({', '.join(mine.positional + mine.kwonly)}) overrides "
                    f"{qual}.{name}({', '.join(them.positional + them.kwonly)}) with other "
                    "parameters",
                )
            concrete = set(ours)
            for bmod, bcls in vllm_bases:
                for _mod, c in _mro(src, bmod, bcls):
                    for item in c.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            if "abstractmethod" not in _decorators(item):
                                concrete.add(item.name)
            for name, qual in abstract.items():
                r.check(name in concrete, f"{where} does not implement abstract {qual}.{name}")


def _fn(r: Report, module: str, name: str, what: str):
    found = resolve_def(r.src, module, name)
    r.check(found is not None, f"{what}: {module} has no {name}")
    return found[1] if found else None


def check_serve_seams(r: Report) -> None:
    src = r.src
    seams = patches.SERVE_SEAMS.get(src.minor)
    if seams is None:
        return
    api = seams.api_server
    if not r.check(src.module(api) is not None, f"serve: no module {api}"):
        return
    top = top_names(src.module(api))
    build = top.get("build_async_engine_client")
    if r.check(
        isinstance(build, ast.AsyncFunctionDef),
        f"serve: {api}.build_async_engine_client is not defined there",
    ):
        p = params(build)
        r.check(
            "asynccontextmanager" in _decorators(build),
            f"serve: {api}.build_async_engine_client is not an asynccontextmanager",
        )
        r.check(
            p.positional[:1] == ["args"] and {"usage_context", "client_config"} <= set(p.kwonly),
            f"serve: {api}.build_async_engine_client signature changed: {p}",
        )
    init = _fn(r, api, "init_app_state", "serve")
    if init is not None:
        r.check(
            params(init).positional[:4] == ["engine_client", "state", "args", "supported_tasks"],
            f"serve: init_app_state signature changed: {params(init)}",
        )
    worker = top.get("run_server_worker")
    if r.check(
        isinstance(worker, ast.AsyncFunctionDef),
        f"serve: {api}.run_server_worker is not defined there",
    ):
        r.check(
            calls_global(worker, "build_async_engine_client"),
            f"serve: {api}.run_server_worker no longer calls build_async_engine_client as a module global",
        )
    bas = top.get("build_and_serve")
    if r.check(
        isinstance(bas, ast.AsyncFunctionDef), f"serve: {api}.build_and_serve is not defined there"
    ):
        r.check(
            calls_global(bas, "init_app_state"),
            f"serve: {api}.build_and_serve no longer calls init_app_state as a module global",
        )
        r.check(
            calls_global(bas, "build_app"),
            f"serve: {api}.build_and_serve no longer calls build_app",
        )
        app = resolve_def(src, api, "build_app")
        if r.check(app is not None, f"serve: {api} has no build_app"):
            attach = [
                n.func.id
                for n in ast.walk(app[1])
                if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Name)
                and (f := resolve_def(src, app[0], n.func.id)) is not None
                and imports_in_body(f[1], "vllm.plugins", "load_endpoint_plugins")
                and calls_attr(f[1], "attach_router")
            ]
            r.check(
                bool(attach),
                "serve: build_app no longer calls a function that imports "
                "vllm.plugins.load_endpoint_plugins at call time and calls attach_router",
            )
    state_mod, _, state_fn = seams.plugins_state.partition(":")
    state = _fn(r, state_mod, state_fn, "serve")
    if state is not None:
        r.check(
            params(state).positional[:3] == ["engine_client", "state", "args"]
            and calls_attr(state, "init_state"),
            f"serve: {seams.plugins_state} no longer runs plugin.init_state(engine_client, state, args)",
        )
    if init is not None and state is not None:
        r.check(
            calls_global(init, state_fn), f"serve: vLLM's init_app_state no longer calls {state_fn}"
        )
    load = _fn(r, "vllm.plugins", "load_endpoint_plugins", "plugins")
    if load is not None:
        r.check(
            params(load).positional[:1] == ["supported_tasks"],
            "plugins: load_endpoint_plugins signature changed",
        )
        r.check(
            "VLLM_PLUGINS" in {n.attr for n in ast.walk(load) if isinstance(n, ast.Attribute)},
            "plugins: load_endpoint_plugins no longer reads envs.VLLM_PLUGINS",
        )
    iface = _fn(r, "vllm.plugins.endpoint_plugins.interface", "EndpointPlugin", "endpoint plugins")
    ours = next(
        n
        for n in ast.parse((ROOT / "entry_points" / "endpoints.py").read_text()).body
        if isinstance(n, ast.ClassDef) and n.name == "OmniImagesPlugin"
    )
    if isinstance(iface, ast.ClassDef):
        fields = set(class_fields(iface))
        r.check(
            {"name", "required_tasks"} <= fields,
            f"endpoint plugins: EndpointPlugin fields changed: {sorted(fields)}",
        )
        for meth in ("attach_router", "init_state"):
            theirs, mine = class_method(iface, meth), class_method(ours, meth)
            r.check(
                theirs is not None
                and mine is not None
                and params(theirs).positional == params(mine).positional
                and isinstance(theirs, ast.AsyncFunctionDef)
                == isinstance(mine, ast.AsyncFunctionDef),
                f"endpoint plugins: EndpointPlugin.{meth} differs from OmniImagesPlugin.{meth}",
            )
    env_keys = string_constants(src.module("vllm.envs") or ast.Module(body=[], type_ignores=[]))
    for key in (
        "VLLM_PLUGINS",
        "VLLM_RUST_FRONTEND_PATH",
        engine_fields_mod.VLLM_PROCESS_NAME_PREFIX_ENV,
    ):
        r.check(key in env_keys, f"envs: vllm/envs.py has no {key}")


def check_cli_seams(r: Report) -> None:
    src = r.src
    args_mod = "vllm.engine.arg_utils"
    engine = _fn(r, args_mod, "EngineArgs", "cli")
    async_args = _fn(r, args_mod, "AsyncEngineArgs", "cli")
    if isinstance(engine, ast.ClassDef):
        add = class_method(engine, "add_cli_args")
        r.check(
            add is not None
            and "staticmethod" in _decorators(add)
            and params(add).positional[:1] == ["parser"],
            "cli: EngineArgs.add_cli_args is no longer a staticmethod add_cli_args(parser)",
        )
    if isinstance(async_args, ast.ClassDef):
        add = class_method(async_args, "add_cli_args")
        ok = (
            add is not None
            and calls_global(add, "load_general_plugins")
            or (
                add is not None
                and "load_general_plugins"
                in {n.id for n in ast.walk(add) if isinstance(n, ast.Name)}
            )
        )
        r.check(ok, "cli: AsyncEngineArgs.add_cli_args no longer calls load_general_plugins()")
        r.check(
            add is not None and calls_attr(add, "add_cli_args", on="EngineArgs"),
            "cli: AsyncEngineArgs.add_cli_args no longer calls EngineArgs.add_cli_args on the class",
        )
    serve_mod = "vllm.entrypoints.cli.serve"
    top = top_names(src.module(serve_mod) or ast.Module(body=[], type_ignores=[]))
    headless = top.get("run_headless")
    r.check(
        isinstance(headless, ast.FunctionDef) and params(headless).positional[:1] == ["args"],
        "cli: vllm/entrypoints/cli/serve.py has no run_headless(args)",
    )
    sub = top.get("ServeSubcommand")
    if r.check(
        isinstance(sub, ast.ClassDef), "cli: no ServeSubcommand in vllm/entrypoints/cli/serve.py"
    ):
        cmd, validate = class_method(sub, "cmd"), class_method(sub, "validate")
        r.check(
            cmd is not None and calls_global(cmd, "run_headless"),
            "cli: ServeSubcommand.cmd no longer calls run_headless as a module global",
        )
        for path in ("run_multi_api_server", "run_dp_supervisor"):
            r.check(
                cmd is not None
                and calls_global(cmd, path)
                and resolve(src, serve_mod, path) is not None,
                f"cli: ServeSubcommand.cmd no longer calls {path} (the mode we refuse moved)",
            )
        r.check(
            validate is not None and calls_global(validate, "validate_parsed_serve_args"),
            "cli: ServeSubcommand.validate no longer calls validate_parsed_serve_args as a module global",
        )
        r.check(
            resolve(src, serve_mod, "validate_parsed_serve_args") is not None,
            "cli: validate_parsed_serve_args does not resolve in vllm/entrypoints/cli/serve.py",
        )
    main = src.module("vllm.entrypoints.cli.main")
    r.check(
        main is not None and calls_attr(main, "validate"),
        "cli: vllm/entrypoints/cli/main.py no longer calls <subcommand>.validate(args)",
    )
    # The dests we refuse with --stage-config: engine fields, or a flag of the serve parser.
    fields = set()
    for cls in (engine, async_args):
        if isinstance(cls, ast.ClassDef):
            fields |= set(class_fields(cls))
    parser_src = resolve(src, serve_mod, "make_arg_parser")
    parser_strings = string_constants(src.module(parser_src.module)) if parser_src else set()
    for dest, flag, _ in patches._REFUSED_SERVE_ARGS:
        r.check(
            dest in fields or flag in parser_strings,
            f"cli: {flag} ({dest}) is neither an engine field nor a serve flag",
        )


def check_registration(r: Report) -> None:
    src = r.src
    plugins = src.module("vllm.plugins")
    strings = string_constants(plugins) if plugins else set()
    for group in ("vllm.general_plugins", "vllm.endpoint_plugins"):
        r.check(
            group in strings, f"plugins: vllm/plugins/__init__.py no longer names the group {group}"
        )
    _fn(r, "vllm.plugins", "load_general_plugins", "plugins")
    # The AR stage hands vLLM its logits processor as "module:Class" in the engine argument
    # (the entry-point group would turn off model runner V2 in every engine on 0.26-0.30).
    lp = src.module("vllm.v1.sample.logits_processor")
    r.check(
        lp is not None
        and "_load_logitsprocs_by_fqcns"
        in {f.name for f in ast.walk(lp) if isinstance(f, ast.FunctionDef)},
        "plugins: vllm/v1/sample/logits_processor no longer loads logits processors by FQCN",
    )
    reg = resolve(src, "vllm", "ModelRegistry")
    reg_cls = None
    if r.check(
        reg is not None and isinstance(reg.node, ast.Assign),
        "models: vllm.ModelRegistry is not an instance",
    ):
        call = reg.node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            reg_cls = resolve_def(src, reg.module, call.func.id)
    if r.check(reg_cls is not None, "models: cannot find ModelRegistry's class"):
        cls = reg_cls[1]
        reg_m, archs = class_method(cls, "register_model"), class_method(cls, "get_supported_archs")
        r.check(
            reg_m is not None and params(reg_m, True).positional[:2] == ["model_arch", "model_cls"],
            "models: ModelRegistry.register_model(model_arch, model_cls) changed",
        )
        r.check(archs is not None, "models: ModelRegistry.get_supported_archs is gone")
    fac = _fn(r, "vllm.distributed.kv_transfer.kv_connector.factory", "KVConnectorFactory", "kv")
    if isinstance(fac, ast.ClassDef):
        m = class_method(fac, "register_connector")
        r.check(
            m is not None
            and params(m, True).positional[:3] == ["name", "module_path", "class_name"],
            "kv: KVConnectorFactory.register_connector(name, module_path, class_name) changed",
        )
        r.check(
            "_registry" in class_fields(fac)
            or "_registry" in top_names(ast.Module(body=fac.body, type_ignores=[])),
            "kv: KVConnectorFactory._registry is gone",
        )
    sched = _fn(r, "vllm.v1.core.sched.scheduler", "Scheduler", "scheduler")
    if isinstance(sched, ast.ClassDef):
        init = class_method(sched, "__init__")
        r.check(
            init is not None and params(init, True).positional[:1] == ["vllm_config"],
            "scheduler: Scheduler.__init__'s first parameter is no longer vllm_config",
        )
    asched = _fn(r, "vllm.v1.core.sched.async_scheduler", "AsyncScheduler", "scheduler")
    if isinstance(asched, ast.ClassDef):
        r.check(
            any(isinstance(b, ast.Name) and b.id == "Scheduler" for b in asched.bases),
            "scheduler: AsyncScheduler no longer subclasses Scheduler",
        )
    cfg = _fn(r, "vllm.config.scheduler", "SchedulerConfig", "scheduler")
    if isinstance(cfg, ast.ClassDef):
        got = set(class_fields(cfg))
        r.check(
            {"async_scheduling", "scheduler_cls"} <= got,
            "scheduler: SchedulerConfig lost async_scheduling/scheduler_cls",
        )


def check_worker_title(r: Report) -> None:
    src = r.src
    title = _fn(r, "vllm.utils.system_utils", "set_process_title", "title")
    if title is not None:
        p = params(title)
        default = dict(
            zip(reversed(p.positional), reversed(title.args.defaults), strict=False)
        ).get("prefix")
        r.check(
            default is not None
            and engine_fields_mod.VLLM_PROCESS_NAME_PREFIX_ENV in ast.unparse(default),
            "title: set_process_title's prefix no longer defaults to envs.VLLM_PROCESS_NAME_PREFIX",
        )
        fstrings = [ast.unparse(n) for n in ast.walk(title) if isinstance(n, ast.JoinedStr)]
        r.check(
            "f'{prefix}::{name}'" in fstrings,
            f"title: set_process_title no longer sets '{{prefix}}::{{name}}' ({fstrings})",
        )
    envs = src.module("vllm.envs")
    key = engine_fields_mod.VLLM_PROCESS_NAME_PREFIX_ENV
    default_ok = envs is not None and any(
        isinstance(n, ast.Call) and [ast.unparse(a) for a in n.args] == [repr(key), "'VLLM'"]
        for n in ast.walk(envs)
    )
    r.check(default_ok, f"title: {key} no longer defaults to 'VLLM' in vllm/envs.py")
    ex = src.module("vllm.v1.executor.multiproc_executor")
    name = engine_fields_mod.VLLM_WORKER_PROCESS_NAME
    r.check(
        ex is not None
        and any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id == "set_process_title"
            and any(isinstance(k.value, ast.Constant) and k.value.value == name for k in n.keywords)
            for n in ast.walk(ex)
        ),
        f"title: the multiproc executor no longer titles its workers {name!r}",
    )


def check_fixed_kv_cache_skips_profiling(r: Report) -> None:
    found = resolve_def(r.src, "vllm.v1.worker.gpu_worker", "Worker")
    fn = class_method(found[1], "determine_available_memory") if found else None
    r.check(
        fn is not None, "memory: vllm.v1.worker.gpu_worker.Worker has no determine_available_memory"
    )
    if fn is None:
        return

    def profiles(node: ast.AST) -> bool:
        return any(
            isinstance(n, ast.Call) and ast.unparse(n.func).endswith("memory_profiling")
            for n in ast.walk(node)
        )

    early = [
        n
        for n in fn.body
        if isinstance(n, ast.If)
        and "kv_cache_memory_bytes" in ast.unparse(n.test)
        and any(isinstance(x, ast.Return) for x in ast.walk(n))
        and not profiles(n)
    ]
    first_profile = next((i for i, n in enumerate(fn.body) if profiles(n)), len(fn.body))
    r.check(
        bool(early) and fn.body.index(early[0]) < first_profile,
        "memory: determine_available_memory no longer returns before memory_profiling when "
        "kv_cache_memory_bytes is set",
    )


def check_engine_fields(r: Report) -> None:
    if r.src.minor not in engine_fields_mod.SUPPORTED_MINORS:
        return
    wheel: dict[str, ast.expr] = {}
    for cls_name in ("EngineArgs", "AsyncEngineArgs"):
        found = resolve_def(r.src, "vllm.engine.arg_utils", cls_name)
        if found and isinstance(found[1], ast.ClassDef):
            wheel.update({k: v for k, v in class_fields(found[1]).items() if not k.startswith("_")})
    ours = engine_fields_mod.engine_fields(r.src.minor)
    for name in sorted(set(ours) - set(wheel)):
        r.check(
            False,
            f"engine fields: {name} is in the {r.src.minor} snapshot but not an engine argument of vLLM {r.src.version}",
        )
    for name in sorted(set(wheel) - set(ours)):
        r.check(
            False,
            f"engine fields: vLLM {r.src.version} has engine argument {name} ({ast.unparse(wheel[name])}), missing from the snapshot",
        )
    for name in sorted(set(wheel) & set(ours)):
        derived = coarse_type(wheel[name])
        r.check(
            derived == "any" or ours[name] in (derived, "any"),
            f"engine fields: {name} is {ast.unparse(wheel[name])} in vLLM {r.src.version}, snapshot says {ours[name]}",
        )


CHECKS = (
    check_window,
    check_serve_seams,
    check_cli_seams,
    check_registration,
    check_worker_title,
    check_fixed_kv_cache_skips_profiling,
    check_engine_fields,
)


def run(
    path: Path,
    files: list[ProjectFile] | None = None,
    overrides: dict[str, str | None] | None = None,
) -> Report:
    src = Source(path, overrides)
    r = Report(src)
    files = files if files is not None else project_files()
    for pf in files:
        pf.vllm_names.clear()
    check_project_imports(r, files)
    check_project_calls(r, files)
    check_project_subclasses(r, files)
    for check in CHECKS:
        check(r)
    return r


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", type=Path, help="vLLM wheels or site-packages dirs")
    args = parser.parse_args(argv)
    files = project_files()
    failed = 0
    for path in args.sources:
        if not path.exists():
            print(f"MISSING {path}")
            failed += 1
            continue
        r = run(path, files)
        status = "OK" if not r.problems else "FAIL"
        print(
            f"{status} vLLM {r.src.version} ({path.name}): {r.checked} checks, {len(r.problems)} problems"
        )
        for problem in r.problems:
            print(f"  - {problem}")
        failed += bool(r.problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
