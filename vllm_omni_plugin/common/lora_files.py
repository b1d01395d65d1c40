"""LoRA adapter folders in diffusers' format, checked against the served transformer.

An adapter is a folder holding `pytorch_lora_weights.safetensors` (what diffusers'
`save_lora_weights` writes and `load_lora_weights` reads; or the folder's only `.safetensors`
file) with, per adapted linear, `transformer.<module>.lora_A.weight` [rank, in] and
`transformer.<module>.lora_B.weight` [out, rank]. Its scaling is PEFT's: `lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`) from diffusers' `lora_adapter_metadata` in the
file's header, else 1 (diffusers' rule without alphas: alpha = rank).

A model with a second expert (Wan2.2: `transformer_2`, the low-noise expert) takes that
expert's file from the adapter's `transformer_2/` sub-folder, in the same format (what
diffusers' `load_lora_weights(folder / "transformer_2", load_into_transformer_2=True)` reads);
an adapter holds either expert's file or both.

`read_adapter` checks the header only (names, shapes, dtypes, metadata): cheap enough for the
API server to run on every request and load (against the target linears the diffusion stage
announced); the stage checks again before `load_tensors` reads the weights. A leaf module (no
torch import at module level), shared by the API server and the diffusion engine.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
SECOND_EXPERT = "transformer_2"  # the sub-folder (and diffusers' component) of a second expert
PREFIX = "transformer."
METADATA_KEY = "lora_adapter_metadata"
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# diffusers' adapter metadata that changes the math we do not implement (refused, not ignored).
_UNSUPPORTED_METADATA = {
    "use_dora": "DoRA adapters",
    "lora_bias": "adapters with a lora_B bias",
}
_PATTERN_METADATA = ("rank_pattern", "alpha_pattern")


class LoraError(ValueError):
    """An adapter that cannot be served; `status` is the HTTP status it maps to (400, 404)."""

    def __init__(self, message: str, status: int = 400, field: str = "lora") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.field = field


@dataclass(frozen=True)
class ExpertFile:
    """One expert's weights file of an adapter, checked: per target module (rank, scaling)."""

    weights: Path
    modules: dict[str, tuple[int, float]]
    stamp: tuple[int, int]  # (mtime_ns, size) of the weights when checked


@dataclass(frozen=True)
class AdapterFile:
    """One adapter's checked headers: where it is, and per expert (`transformer`, then
    `transformer_2` where the model has one) its file, or None where it adapts not that one."""

    folder: Path
    experts: tuple[ExpertFile | None, ...]

    @property
    def stamp(self) -> tuple[tuple[int, int] | None, ...]:
        return tuple(e.stamp if e is not None else None for e in self.experts)

    @property
    def rank(self) -> int:
        return max(r for e in self.experts if e is not None for r, _ in e.modules.values())


def resolve_folder(root: str | Path, path: str) -> Path:
    """The adapter folder `path` (relative to `root`, or absolute) with links resolved; it must
    lie inside `root` (400 otherwise) and exist (404)."""
    base = Path(root).resolve()
    given = Path(path)
    folder = (given if given.is_absolute() else base / given).resolve()
    if folder == base or base not in folder.parents:
        raise LoraError(
            f"{path!r} is outside the adapter directory {str(base)!r}", field="lora_path"
        )
    if not folder.is_dir():
        raise LoraError(f"no adapter folder {path!r} in {str(base)!r}", 404, field="lora_path")
    return folder


def weight_file(folder: Path, adapter: Path | None = None) -> Path | None:
    """`pytorch_lora_weights.safetensors`, else the folder's only .safetensors file; None where
    the folder holds none. `adapter`: the adapter's folder (default `folder`), which a link may
    not leave."""
    adapter = folder if adapter is None else adapter
    path = folder / WEIGHT_NAME
    if not path.is_file():
        found = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
        if not found:
            return None
        if len(found) != 1:
            raise LoraError(
                f"adapter folder {folder.name!r} must hold {WEIGHT_NAME} (diffusers' LoRA "
                f"format), found {[p.name for p in found]}"
            )
        path = found[0]
    real = path.resolve()
    if adapter not in real.parents:  # a link out of the folder is a path outside the directory
        raise LoraError(f"{path.name} in {folder.name!r} links outside its folder")
    return real


def _stamp(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size


def _header(path: Path) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """(tensor name -> (dtype, shape), __metadata__) from a safetensors header, or LoraError."""
    try:
        with open(path, "rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) != 8:
                raise ValueError("file too short")
            size = int.from_bytes(size_bytes, "little")
            if size > 100 << 20 or size > os.fstat(f.fileno()).st_size - 8:
                raise ValueError("header length out of range")
            raw = json.loads(f.read(size))
        if not isinstance(raw, dict):
            raise ValueError("header is not an object")
        meta = raw.pop("__metadata__", None) or {}
        tensors = {}
        for name, info in raw.items():
            tensors[name] = (str(info["dtype"]), [int(d) for d in info["shape"]])
        if not isinstance(meta, dict):
            raise ValueError("__metadata__ is not an object")
        return tensors, {str(k): str(v) for k, v in meta.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LoraError(f"{path.name} is not a readable safetensors file: {exc}") from None


def _scaling(meta: dict[str, str], ranks: dict[str, int], where: str) -> dict[str, float]:
    """Per module scaling (alpha / r) from diffusers' adapter metadata (absent: 1.0)."""
    raw = meta.get(METADATA_KEY)
    if raw is None:
        return dict.fromkeys(ranks, 1.0)
    try:
        packed = json.loads(raw)
        config = {
            k[len(PREFIX) :]: v
            for k, v in packed.items()
            if isinstance(k, str) and k.startswith(PREFIX)
        }
    except (ValueError, AttributeError):
        raise LoraError(f"{where}: {METADATA_KEY} is not a JSON object") from None
    for key, what in _UNSUPPORTED_METADATA.items():
        if config.get(key):
            raise LoraError(f"{where}: {what} are not supported")
    for key in _PATTERN_METADATA:
        if config.get(key):
            raise LoraError(f"{where}: per-module {key} is not supported")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if r is None:
        return dict.fromkeys(ranks, 1.0)
    if not isinstance(r, int) or not isinstance(alpha, (int, float)) or r < 1:
        raise LoraError(f"{where}: metadata r / lora_alpha must be numbers, got {r!r} / {alpha!r}")
    bad = sorted(m for m, rank in ranks.items() if rank != r)
    if bad:
        raise LoraError(f"{where}: module {bad[0]} has rank {ranks[bad[0]]}, the metadata says {r}")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return dict.fromkeys(ranks, float(scale))


def read_adapter(
    folder: Path,
    targets: dict[str, tuple[int, int]],
    max_rank: int,
    family: str,
    second_targets: dict[str, tuple[int, int]] | None = None,
) -> AdapterFile:
    """Check an adapter's headers against the transformer's target linears (name -> (in, out);
    `second_targets`: the second expert's, where the model has one) and the stage's max_rank;
    nothing is loaded. LoraError says what does not fit."""
    where = f"adapter {folder.name!r}"
    sub = folder / SECOND_EXPERT
    experts: list[ExpertFile | None] = []
    first = weight_file(folder)
    experts.append(None if first is None else _read_file(first, where, targets, max_rank, family))
    if second_targets is not None:
        second = weight_file(sub, folder) if sub.is_dir() else None
        experts.append(
            None
            if second is None
            else _read_file(second, f"{where} ({SECOND_EXPERT})", second_targets, max_rank, family)
        )
    elif sub.is_dir():
        raise LoraError(
            f"{where} holds {SECOND_EXPERT}/ (a second expert's adapter); {family} here has "
            "one transformer"
        )
    if all(e is None for e in experts):
        found = sorted(p.name for p in folder.iterdir())
        also = f" or {SECOND_EXPERT}/{WEIGHT_NAME}" if second_targets is not None else ""
        raise LoraError(
            f"adapter folder {folder.name!r} must hold {WEIGHT_NAME}{also} (diffusers' LoRA "
            f"format), found {found}"
        )
    return AdapterFile(folder, tuple(experts))


def _read_file(
    path: Path, where: str, targets: dict[str, tuple[int, int]], max_rank: int, family: str
) -> ExpertFile:
    stamp = _stamp(path)
    tensors, meta = _header(path)
    if not tensors:
        raise LoraError(f"{where} holds no tensors")
    pairs: dict[str, dict[str, list[int]]] = {}
    for name, (dtype, shape) in tensors.items():
        if not name.startswith(PREFIX):
            raise LoraError(
                f"{where} adapts {name.split('.')[0]!r}; only the transformer of {family} "
                "takes LoRA here (diffusers' `transformer.` keys)"
            )
        if name.endswith(A_SUFFIX):
            module, part = name[len(PREFIX) : -len(A_SUFFIX)], "A"
        elif name.endswith(B_SUFFIX):
            module, part = name[len(PREFIX) : -len(B_SUFFIX)], "B"
        else:
            raise LoraError(f"{where}: {name} is not a lora_A / lora_B weight (unsupported format)")
        if dtype not in _FLOAT_DTYPES or len(shape) != 2:
            raise LoraError(f"{where}: {name} must be a 2-D float tensor, got {dtype} {shape}")
        pairs.setdefault(module, {})[part] = shape
    ranks: dict[str, int] = {}
    for module, parts in sorted(pairs.items()):
        if module not in targets:
            raise LoraError(
                f"{where} does not fit {family}: the transformer has no target linear "
                f"{module!r} (an adapter for another model family?)"
            )
        if set(parts) != {"A", "B"}:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise LoraError(f"{where}: {module} has no {missing} weight")
        (rank, a_in), (b_out, b_rank) = parts["A"], parts["B"]
        t_in, t_out = targets[module]
        if a_in != t_in or b_out != t_out or b_rank != rank:
            raise LoraError(
                f"{where} does not fit {family}: {module} is {t_in} -> {t_out}, the adapter's "
                f"lora_A is {parts['A']} and lora_B {parts['B']} (another model's adapter?)"
            )
        if rank > max_rank:
            raise LoraError(f"{where} has rank {rank} at {module}, above lora.max_rank={max_rank}")
        if rank < 1:
            raise LoraError(f"{where}: {module} has rank 0")
        ranks[module] = rank
    scaling = _scaling(meta, ranks, where)
    return ExpertFile(path, {m: (ranks[m], scaling[m]) for m in ranks}, stamp)


def load_tensors(
    adapter: AdapterFile, device: Any, dtype: Any
) -> tuple[dict[str, tuple[Any, Any, float]], ...]:
    """Per expert, module -> (lora_A, lora_B, scaling) on `device` in `dtype` (empty where the
    adapter adapts not that expert); the files must be the ones that were checked (same size
    and modification time), else LoraError."""
    return tuple(
        {} if e is None else _load_expert(adapter.folder.name, e, device, dtype)
        for e in adapter.experts
    )


def _load_expert(name: str, expert: ExpertFile, device: Any, dtype: Any) -> dict:
    from safetensors.torch import load_file

    if _stamp(expert.weights) != expert.stamp:
        raise LoraError(f"adapter {name!r} changed on disk since it was checked")
    try:
        tensors = load_file(str(expert.weights), device="cpu")
    except Exception as exc:  # a truncated or corrupt body
        raise LoraError(f"adapter {name!r}: cannot read its weights: {exc}") from None
    out = {}
    for module, (rank, scaling) in expert.modules.items():
        a = tensors[PREFIX + module + A_SUFFIX]
        b = tensors[PREFIX + module + B_SUFFIX]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise LoraError(f"adapter {name!r} changed on disk since it was checked")
        out[module] = (a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(), scaling)
    return out
