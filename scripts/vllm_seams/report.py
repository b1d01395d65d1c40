"""The tally of one vLLM source's checks: `Report` counts every check and keeps the message
of each that failed; `_fn` checks that a function or class is defined (or re-exported) where
a seam expects it and returns its node.
"""

from __future__ import annotations

from .source import Source, resolve_def


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


def _fn(r: Report, module: str, name: str, what: str):
    found = resolve_def(r.src, module, name)
    r.check(found is not None, f"{what}: {module} has no {name}")
    return found[1] if found else None
