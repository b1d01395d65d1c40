"""vLLM's sources, read without importing vLLM: `Source` reads a wheel or a directory (and
the version it declares), and `resolve` / `resolve_def` find where `from module import name`
ends up, following re-exports, star imports and vLLM's lazy `MODULE_ATTRS`; `_mro` and
`_find_in_mro` walk a vLLM class's bases through those sources.
"""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .ast_helpers import class_method
from .tables import patches


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
            self._ast[dotted] = self._parse(rel) if rel else None
        return self._ast[dotted]

    def _parse(self, rel: str) -> ast.Module:
        text = self.read(rel) or ""
        if rel in self.overrides:
            return ast.parse(text, rel)
        if _PARSED_FROM != [self.path]:
            _PARSED.clear()
            _PARSED_FROM[:] = [self.path]
        cached = _PARSED.get(rel)
        if cached is None or cached[0] != text:
            cached = _PARSED[rel] = (text, ast.parse(text, rel))
        return cached[1]


# The last source's trees, by path in the package, with the text each was parsed from: the
# checks only read them, and the tests check the installed sources many times over, one file
# edited each time. One source's only, as holding every minor's costs memory and exit time.
_PARSED: dict[str, tuple[str, ast.Module]] = {}
_PARSED_FROM: list[Path] = []


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
