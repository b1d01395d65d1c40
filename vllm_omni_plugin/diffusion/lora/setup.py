"""The engine's side of LoRA: the stage's `lora` settings, what they cannot be combined with,
the store for a family that declares its target modules, and a request's `lora` field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...common.lora_files import LoraError
from ...common.lora_request import LoraFieldError, LoraRef, parse_lora
from ..errors import DiffusionEngineError, RequestValidationError
from .store import CheckedLora, LoraStore

DEFAULT_MAX_LOADED = 4
DEFAULT_MAX_RANK = 64
_SETTINGS = {"dir", "max_loaded", "max_rank"}


def settings(raw: dict[str, Any]) -> tuple[str, int, int]:
    """(dir, max_loaded, max_rank) of the stage's `lora` section; DiffusionEngineError naming
    the setting otherwise (the deploy file's LoraOwner checks the same at load)."""
    unknown = sorted(set(raw) - _SETTINGS)
    if unknown:
        raise DiffusionEngineError(f"lora: unknown settings {unknown}")
    root = raw.get("dir")
    if not isinstance(root, str) or not Path(root).is_dir():
        raise DiffusionEngineError(f"lora.dir: {root!r} is not a folder")
    out = [root]
    for key, default in (("max_loaded", DEFAULT_MAX_LOADED), ("max_rank", DEFAULT_MAX_RANK)):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DiffusionEngineError(f"lora.{key}: must be an integer >= 1, got {value!r}")
        out.append(value)
    return out[0], out[1], out[2]


def conflicts(config: Any) -> str | None:
    """Why this engine config cannot serve LoRA (None: it can). The wrapped linears take a new
    row plan every forward, which a captured graph or fused / quantized linear would not."""
    if config.world_size > 1:
        return "cfg_parallel / ulysses_degree > 1 (the ranks would need the plan too)"
    if config.step_cache and config.step_cache.get("policies"):
        return "step_cache (its cached rows skip the adapters' rows)"
    if config.compile_transformer:
        return "compile_transformer (each forward's row plan would recompile)"
    if config.cuda_graphs:
        return "cuda_graphs: true (a graph replays one row plan)"
    if config.fp8_linear:
        return "fp8_linear (the adapted linears stay in the model dtype)"
    if config.fuse_gelu:
        return "fuse_gelu: true (the fused up-projections are no longer linears to adapt)"
    if config.fuse_qkv:
        return "fuse_qkv (the fused projection is no longer the adapters' to_q / to_k / to_v)"
    return None


def build_store(config: Any, adapter: Any, device: Any, dtype: Any) -> LoraStore | None:
    """The engine's LoraStore, or None where the stage sets no `lora`."""
    if config.lora is None:
        return None
    root, max_loaded, max_rank = settings(dict(config.lora))
    family = type(adapter).family or type(adapter).pipeline_class
    prefixes = tuple(getattr(adapter, "lora_targets", ()))
    if not prefixes or not adapter.step_batched:
        raise DiffusionEngineError(f"lora: {family} does not take LoRA adapters here")
    why = conflicts(config)
    if why is not None:
        raise DiffusionEngineError(f"lora cannot be combined with {why}")
    try:
        return LoraStore(
            adapter.lora_models(),
            prefixes,
            root=root,
            max_loaded=max_loaded,
            max_rank=max_rank,
            family=family,
            device=device,
            dtype=dtype,
        )
    except TypeError as exc:
        raise DiffusionEngineError(f"lora: {exc}") from exc


def check_request(store: LoraStore | None, value: Any) -> tuple[CheckedLora, ...]:
    """A request's `lora` ([{"name", "scale", "path"}]) checked, files included; nothing is
    loaded. RequestValidationError naming the field otherwise."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    paths = []
    plain = []
    for item in items:
        if isinstance(item, dict) and "path" in item:
            path = item["path"]
            item = {k: v for k, v in item.items() if k != "path"}
        else:
            path = None
        plain.append(item)
        paths.append(path)
    try:
        refs: tuple[LoraRef, ...] = parse_lora(plain)
    except LoraFieldError as exc:
        raise RequestValidationError(exc.field, exc.message) from None
    if not refs:
        return ()
    if store is None:
        raise RequestValidationError("lora", "this stage serves no LoRA adapters (no lora.dir)")
    try:
        return store.check(
            [(r, p if isinstance(p, str) else r.name) for r, p in zip(refs, paths, strict=True)]
        )
    except LoraError as exc:
        raise RequestValidationError("lora", exc.message) from None
