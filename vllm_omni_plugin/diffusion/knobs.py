"""Request knobs a model family applies beyond the common fields (plain Python: no torch).

Each adapter declares its knobs (`DiffusionAdapter.knobs`); a stage announces the ones its
loaded model applies in its Ready info, and the API server checks a request's values against
them (type and bounds) before any stage sees it. The engine checks them again, so a request that
bypasses the API server is refused just the same.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

KINDS = ("number", "integer", "boolean", "string")


class KnobError(ValueError):
    """A knob's value is refused; `code` is OpenAI's error code for it."""

    def __init__(self, name: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.name = name
        self.message = message
        self.code = code


@dataclass(frozen=True)
class Knob:
    """One request field a family applies, under the name diffusers' pipeline gives it."""

    name: str  # the request field (diffusers' __call__ argument or pipeline config name)
    kind: str  # JSON type: "number", "integer", "boolean" or "string"
    doc: str  # one line for the OpenAPI schema and the README
    minimum: float | None = None  # inclusive
    maximum: float | None = None  # inclusive

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"knob {self.name}: kind must be one of {KINDS}, got {self.kind!r}")

    def check(self, value: Any) -> Any:
        """The value as the stage receives it (an int stays an int), or KnobError."""
        if self.kind == "boolean":
            if not isinstance(value, bool):
                raise KnobError(self.name, f"'{self.name}' must be true or false", "invalid_type")
            return value
        if self.kind == "string":
            if not isinstance(value, str):
                raise KnobError(self.name, f"'{self.name}' must be a string", "invalid_type")
            return value
        numeric = (int,) if self.kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric):
            kind = "an integer" if self.kind == "integer" else "a number"
            raise KnobError(self.name, f"'{self.name}' must be {kind}", "invalid_type")
        if not math.isfinite(value):
            raise KnobError(self.name, f"'{self.name}' must be finite")
        lo, hi = self.minimum, self.maximum
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise KnobError(
                self.name,
                f"'{self.name}' must be in [{_fmt(lo, '-inf')}, {_fmt(hi, 'inf')}], got {value}",
            )
        return float(value) if self.kind == "number" else value

    def schema(self) -> dict[str, Any]:
        """The knob's JSON schema (the routes' OpenAPI bodies)."""
        out: dict[str, Any] = {"type": self.kind, "description": self.doc}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the Ready info (every link encodes them)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Knob:
        return cls(**data)


def check_knobs(declared: tuple[Knob, ...], values: dict[str, Any]) -> dict[str, Any]:
    """`values` checked against the declared knobs; an undeclared one is refused (KnobError)."""
    by_name = {k.name: k for k in declared}
    out = {}
    for name, value in values.items():
        knob = by_name.get(name)
        if knob is None:
            raise KnobError(name, f"'{name}' is not a knob of this model", "unknown_parameter")
        out[name] = knob.check(value)
    return out


def _fmt(bound: float | None, unbounded: str) -> str:
    return unbounded if bound is None else f"{bound:g}"
