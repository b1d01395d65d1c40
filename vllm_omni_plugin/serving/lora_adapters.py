"""The LoRA adapters this server serves, and the `lora` request field on every image and video
route.

The adapters are the folders under the diffusion stage's `lora.dir` (the folder's name is the
adapter's) plus those loaded at run time (`POST /v1/load_lora_adapter`, when vLLM's
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` is on) minus those unloaded. A request names adapters with
`lora: [{"name", "scale"}]`: each name must be served (404 otherwise) and its files must fit the
stage's model (the header checked here against the target linears the stage announced: rank
above `max_rank`, another family's adapter, a malformed file, a path outside the directory are
400s), all before any stage is touched; the stage checks again before it loads anything.

Multipart forms (edits, videos from the openai client) carry the field as `lora[][name]`,
`lora[][scale]` text fields (the client's bracket format: the k-th name and the k-th scale
belong to the k-th adapter), as numbered `lora[0][name]`, `lora[0][scale]` fields, or as one
`lora` field holding JSON. The client writes every name, then every scale, so bracket fields
where some adapters have a scale and others not cannot be paired: such a form is refused (as
is a form mixing the ways), never paired by guess.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

from ..common.lora_files import LoraError, read_adapter, resolve_folder
from ..common.lora_request import LoraFieldError, check_name, parse_lora
from .errors import APIError, invalid, unavailable

_FORM_KEY = re.compile(r"^lora\[(\d*)\]\[(name|scale)\]$")
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "description": "An adapter's name (see /v1/models)"},
            "scale": {"type": "number", "description": "Its strength (default 1.0)"},
        },
        "required": ["name"],
    },
    "description": "LoRA adapters to run with, each with its scale (diffusion stages with lora.dir)",
}


def check_field(value: Any) -> list[dict[str, Any]]:
    """The request field's syntax and bounds (request_fields.EXTENSIONS' check)."""
    try:
        return [r.as_dict() for r in parse_lora(value)]
    except LoraFieldError as exc:
        kind = "invalid_type" if "must be" in exc.message else "invalid_value"
        raise invalid(f"{exc.field}: {exc.message}", exc.field, kind) from None


class _FormAdapters(list):
    """data["lora"] while a form's fields fold into it, and the ways they were written."""

    def __init__(self) -> None:
        super().__init__()
        self.ways: set[str] = set()  # "brackets" (lora[][k]), "numbered" (lora[0][k])


def fold_form_field(data: dict[str, Any], name: str, value: Any) -> bool:
    """Fold one multipart text field into data["lora"] if it is part of it; True if it was.
    Call `finish_form_fields` once every field is folded."""
    if name == "lora" and isinstance(value, str):
        if "lora" in data:
            raise invalid("parameter 'lora' is given twice", "lora", "invalid_value")
        try:
            data["lora"] = json.loads(value)
        except ValueError:
            raise invalid(
                "'lora' must be a JSON list of adapters", "lora", "invalid_type"
            ) from None
        return True
    match = _FORM_KEY.match(name)
    if match is None:
        return False
    items = data.setdefault("lora", _FormAdapters())
    if not isinstance(items, _FormAdapters):
        raise invalid(f"parameter '{name}' is given twice", "lora", "invalid_value")
    index, key = match.group(1), match.group(2)
    if index:
        items.ways.add("numbered")
        i = int(index)
        if i > len(items) or i > 64:
            raise invalid(f"'{name}': adapters must be numbered from 0", "lora", "invalid_value")
    else:
        # Brackets (the openai client's format, which groups repeated keys: every name, then
        # every scale): the k-th value of a key belongs to the k-th adapter.
        items.ways.add("brackets")
        i = next((j for j, item in enumerate(items) if key not in item), len(items))
    if i == len(items):
        items.append({})
    if key in items[i]:
        raise invalid(f"parameter '{name}' is given twice", "lora", "invalid_value")
    if key == "scale":
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise invalid(
                f"invalid type for 'lora[{i}].scale': expected a number",
                f"lora[{i}].scale",
                "invalid_type",
            ) from None
    items[i][key] = value
    return True


def finish_form_fields(data: dict[str, Any]) -> None:
    """After the last field: refuse `lora` fields whose adapters and scales cannot be paired
    for certain, and leave data["lora"] a plain list."""
    items = data.get("lora")
    if not isinstance(items, _FormAdapters):
        return
    if len(items.ways) > 1:
        raise invalid(
            "'lora' fields mix lora[][...] and numbered lora[N][...]: use one way",
            "lora",
            "invalid_value",
        )
    if items.ways == {"brackets"}:
        names = sum("name" in item for item in items)
        scales = sum("scale" in item for item in items)
        if scales and (names != len(items) or scales != len(items)):
            raise invalid(
                f"{names} lora[][name] and {scales} lora[][scale] fields cannot be paired: the "
                "k-th scale goes with the k-th name, so give every adapter a scale (or none: "
                "1.0 each), number them (lora[0][name], lora[0][scale]) or send 'lora' as one "
                "JSON field",
                "lora",
                "invalid_value",
            )
    data["lora"] = list(items)


def _targets(raw: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {k: (int(v[0]), int(v[1])) for k, v in raw.items()}


class LoraRegistry:
    """The adapters served by one final diffusion stage (its announced `lora` facts)."""

    def __init__(self, facts: dict[str, Any]) -> None:
        self.root = Path(facts["dir"])
        self.max_loaded = int(facts["max_loaded"])
        self.max_rank = int(facts["max_rank"])
        self.family = str(facts["family"])
        self.targets = _targets(facts["targets"])
        # Wan2.2's low-noise expert (`transformer_2`): None where the model has one transformer.
        second = facts.get("targets_2")
        self.second_targets = None if second is None else _targets(second)
        self._loaded: dict[str, str] = {}  # loaded at run time: name -> folder under root
        self._unloaded: set[str] = set()  # folders of root unloaded at run time
        self._lock = threading.Lock()

    def _check(self, path: str) -> Path:
        folder = resolve_folder(self.root, path)
        read_adapter(folder, self.targets, self.max_rank, self.family, self.second_targets)
        return folder

    def path_of(self, name: str) -> str | None:
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
            if name in self._unloaded:
                return None
        return name if (self.root / name).is_dir() else None

    def served(self) -> dict[str, str]:
        """name -> adapter folder, for every adapter a request may name now (valid ones)."""
        out = {}
        names = {p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")}
        with self._lock:
            names = (names - self._unloaded) | set(self._loaded)
        for name in sorted(names):
            path = self.path_of(name)
            if path is None:
                continue
            try:
                out[name] = str(self._check(path))
            except LoraError:
                continue  # a broken folder is not listed; a request naming it gets the 400
        return out

    def resolve(self, refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The request's checked adapters with their folders; APIError (4xx) otherwise."""
        if len(refs) > self.max_loaded:
            raise invalid(
                f"{len(refs)} adapters in one request exceed this stage's lora.max_loaded="
                f"{self.max_loaded}",
                "lora",
            )
        out = []
        for i, ref in enumerate(refs):
            path = self.path_of(ref["name"])
            if path is None:
                raise APIError(
                    404,
                    f"LoRA adapter {ref['name']!r} is not loaded (see /v1/models)",
                    param=f"lora[{i}].name",
                    code="lora_not_found",
                )
            try:
                folder = self._check(path)
            except LoraError as exc:
                raise APIError(
                    exc.status, exc.message, param=f"lora[{i}]", code="invalid_lora"
                ) from None
            out.append({**ref, "path": str(folder.relative_to(self.root.resolve()))})
        return out

    def load(self, name: str, path: str, inplace: bool = False) -> None:
        """POST /v1/load_lora_adapter: check, then serve `name` from `path`; LoraError (4xx,
        nothing recorded) otherwise."""
        try:
            check_name(name)
        except LoraFieldError as exc:
            raise LoraError(exc.message, field="lora_name") from None
        folder = self._check(path)
        with self._lock:
            if not inplace and self._served_now(name):
                raise LoraError(
                    f"LoRA adapter {name!r} is already loaded (set load_inplace to replace it)",
                    field="lora_name",
                )
            self._loaded[name] = str(folder.relative_to(self.root.resolve()))
            self._unloaded.discard(name)

    def _served_now(self, name: str) -> bool:
        if name in self._loaded:
            return True
        return name not in self._unloaded and (self.root / name).is_dir()

    def unload(self, name: str) -> None:
        """POST /v1/unload_lora_adapter; LoraError 404 for a name not served."""
        with self._lock:
            if not self._served_now(name):
                raise LoraError(f"LoRA adapter {name!r} is not loaded", 404, field="lora_name")
            self._loaded.pop(name, None)
            if (self.root / name).is_dir():
                self._unloaded.add(name)


class LoraAdapters:
    """The server's registry, made once the final stage announced its `lora` facts."""

    def __init__(self, orchestrator: Any) -> None:
        self._orchestrator = orchestrator
        self._registry: LoraRegistry | None = None

    def registry(self) -> LoraRegistry | None:
        if self._registry is None:
            info = self._orchestrator.final_info()
            facts = getattr(info, "lora", None) if info is not None else None
            if facts:
                self._registry = LoraRegistry(facts)
        return self._registry

    def require(self) -> LoraRegistry:
        registry = self.registry()
        if registry is not None:
            return registry
        if self._orchestrator.final_info() is None:
            raise unavailable("the diffusion stage is starting; retry shortly")
        raise invalid(
            "this model serves no LoRA adapters (its diffusion stage sets no lora.dir)",
            "lora",
            "unsupported_parameter",
        )

    def resolve(self, refs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        return self.require().resolve(refs) if refs else []
