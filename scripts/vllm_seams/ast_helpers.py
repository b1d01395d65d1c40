"""Reading one definition found in vLLM's sources (or ours) with `ast`: a class's methods and
annotated fields, a function's parameters and decorators, whether it calls a name as a module
global or as an attribute, its string constants, and the coarse type of an annotation.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field


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
