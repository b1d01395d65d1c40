"""The `lora` request field: which LoRA adapters one image or video request runs with.

`{"lora": [{"name": "pixel-art", "scale": 0.8}, ...]}`: each adapter by its name (the folder's
name under the diffusion stage's `lora.dir`, or a name loaded at run time) and its strength (the
weight diffusers' `set_adapters` takes; default 1.0). The API server checks the syntax and bounds
here, and that each name is known; the diffusion stage checks the adapter files against its
model again before anything is loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# Most adapters one request may combine (the stage's lora.max_loaded bounds it further).
MAX_ADAPTERS_PER_REQUEST = 8
# Largest |scale|: far beyond any useful strength, small enough to keep activations finite.
MAX_SCALE = 100.0
# Adapter names: a folder name without path separators or a leading dot.
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
FIELD = "lora"


class LoraFieldError(ValueError):
    """A malformed `lora` value; `field` names the part at fault (e.g. "lora[1].scale")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class LoraRef:
    """One adapter of a request: its name and the scale its low-rank update is multiplied by."""

    name: str
    scale: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scale": self.scale}


def check_name(name: Any, where: str = "lora_name") -> str:
    if not isinstance(name, str) or not NAME_RE.match(name) or ".." in name:
        raise LoraFieldError(
            where,
            f"must be an adapter name of letters, digits, '_', '-' and '.' (a folder name), "
            f"got {name!r}",
        )
    return name


def parse_lora(value: Any) -> tuple[LoraRef, ...]:
    """The request's `lora` as checked refs (empty: none); LoraFieldError naming the item."""
    if value is None:
        return ()
    if isinstance(value, dict):  # one adapter given as an object
        value = [value]
    if not isinstance(value, list):
        raise LoraFieldError(FIELD, 'must be a list like [{"name": "style", "scale": 0.8}]')
    if len(value) > MAX_ADAPTERS_PER_REQUEST:
        raise LoraFieldError(
            FIELD, f"at most {MAX_ADAPTERS_PER_REQUEST} adapters per request, got {len(value)}"
        )
    out: list[LoraRef] = []
    for i, item in enumerate(value):
        where = f"{FIELD}[{i}]"
        if not isinstance(item, dict):
            raise LoraFieldError(where, 'must be an object like {"name": "style", "scale": 0.8}')
        unknown = sorted(set(item) - {"name", "scale"})
        if unknown:
            raise LoraFieldError(
                f"{where}.{unknown[0]}", "unknown key (an adapter has name, scale)"
            )
        if "name" not in item:
            raise LoraFieldError(f"{where}.name", "is required")
        name = check_name(item["name"], f"{where}.name")
        scale = item.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise LoraFieldError(f"{where}.scale", f"must be a number, got {scale!r}")
        if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
            raise LoraFieldError(f"{where}.scale", f"must be in [-{MAX_SCALE}, {MAX_SCALE}]")
        if any(r.name == name for r in out):
            raise LoraFieldError(f"{where}.name", f"adapter {name!r} is given twice")
        out.append(LoraRef(name, float(scale)))
    return tuple(out)
