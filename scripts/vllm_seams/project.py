"""The project's own code checked against vLLM's sources: `project_files` parses every module
of vllm_omni_plugin/ and entry_points/, and the `check_project_*` checks that its vLLM imports
resolve, that its calls into vLLM use keywords the callee accepts, and that its subclasses of
vLLM classes override with matching parameters and implement the abstract methods.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from .ast_helpers import Params, _decorators, params
from .report import Report
from .source import Source, _find_in_mro, _mro, resolve, resolve_def
from .tables import ROOT

PROJECT_DIRS = ("vllm_omni_plugin", "entry_points")


@dataclass
class ProjectFile:
    path: Path
    dotted: str
    tree: ast.Module
    vllm_names: dict[str, tuple[str, str]] = field(default_factory=dict)  # local -> (mod, name)
    _vllm_imports: list[ast.Import | ast.ImportFrom] | None = field(default=None, repr=False)
    _calls: list[ast.Call] | None = field(default=None, repr=False)

    # The file's vLLM imports (less the optional ones) and its calls of plain names, found once:
    # a tree is walked for them on every `run`, and the tests run the checks many times.
    def vllm_imports(self) -> list[ast.Import | ast.ImportFrom]:
        if self._vllm_imports is None:
            optional = _guarded_by_import_error(self.tree)
            self._vllm_imports = [
                node
                for node in ast.walk(self.tree)
                if (
                    isinstance(node, ast.ImportFrom)
                    and not node.level
                    and node.module
                    and (node.module == "vllm" or node.module.startswith("vllm."))
                    and node.lineno not in optional
                )
                or (
                    isinstance(node, ast.Import)
                    and any(a.name == "vllm" or a.name.startswith("vllm.") for a in node.names)
                )
            ]
        return self._vllm_imports

    def name_calls(self) -> list[ast.Call]:
        if self._calls is None:
            self._calls = [
                node
                for node in ast.walk(self.tree)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            ]
        return self._calls


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


def check_project_imports(r: Report, files: list[ProjectFile]) -> None:
    src = r.src
    for pf in files:
        for node in pf.vllm_imports():
            where = f"{pf.path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(node, ast.ImportFrom):
                if not r.check(
                    src.module(node.module) is not None, f"{where}: no module {node.module}"
                ):
                    continue
                for alias in node.names:
                    found = resolve(src, node.module, alias.name)
                    if r.check(found is not None, f"{where}: {node.module} has no {alias.name}"):
                        pf.vllm_names[alias.asname or alias.name] = (node.module, alias.name)
            else:
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
        for node in pf.name_calls():
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
