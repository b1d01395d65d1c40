"""The support window: the minor a source declares must have a `SERVE_SEAMS` row and an
engine-field table, and that table must equal the release's EngineArgs/AsyncEngineArgs fields,
both ways, with matching coarse types where the annotation is a plain type.
"""

from __future__ import annotations

import ast

from .ast_helpers import class_fields, coarse_type
from .report import Report
from .source import resolve_def
from .tables import engine_fields_mod, patches


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
