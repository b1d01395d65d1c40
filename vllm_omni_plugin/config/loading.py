"""Reading deploy YAMLs: file lookup, YAML syntax, OmegaConf interpolation, `base_config`.

Interpolation (OmegaConf resolvers) is resolved leaf by leaf so that an error names its field:

    tensor_parallel_size: ${oc.env:AR_TP,1}            # env var with a default
    tensor_parallel_size: ${oc.decode:${oc.env:AR_TP,1}}  # same, decoded to a YAML value
    devices: ${oc.env:AR_DEVICES}                       # no default: unset is an error
    max_num_seqs: ${stages[0].max_num_seqs}             # another value of the same file

Values are typed after resolution by the schema ("2" for an int field becomes 2).
`oc.decode` here also accepts non-string input (OmegaConf 2.3 passes an `oc.env` default such as
`1` through as an int and then `oc.decode` raises TypeError); any other resolver works as usual.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.resolvers import oc as _oc

from vllm_omni_plugin.config.errors import ProblemSink

_ENV_REF = re.compile(r"oc\.env\s*:\s*([A-Za-z_][A-Za-z0-9_]*)")
_MISSING_ENV = re.compile(r"Environment variable '([^']+)' not found")


def _tolerant_decode(expr: Any, _parent_: Any, _node_: Any) -> Any:
    if expr is None or isinstance(expr, str):
        return _oc.decode(expr, _parent_=_parent_, _node_=_node_)
    return expr  # already a value (e.g. an int default of oc.env): nothing to decode


_decode_installed = False


def _install_tolerant_decode() -> None:
    """Swap in the tolerant `oc.decode` when the first config is loaded, not at import: the
    resolver table is process-wide, and for string input the two behave the same."""
    global _decode_installed
    if _decode_installed:
        return
    if hasattr(OmegaConf, "register_resolver"):  # OmegaConf 2.4 (register_new_resolver deprecated)
        OmegaConf.register_resolver(
            "oc.decode", _tolerant_decode, replace=True, annotation_validation="off"
        )
    else:  # OmegaConf 2.3
        OmegaConf.register_new_resolver("oc.decode", _tolerant_decode, replace=True)
    _decode_installed = True


Path_ = tuple[Any, ...]


@dataclass
class LoadedFile:
    """One YAML file, interpolation resolved, as plain Python data."""

    path: Path
    data: dict[str, Any]
    env_refs: dict[Path_, list[str]] = field(default_factory=dict)
    """Leaf path -> environment variables its value was interpolated from."""


def bundled_dir() -> Path:
    """The folder of our shipped deploy YAMLs (installed or in a source checkout)."""
    try:
        from importlib.resources import files

        return Path(str(files("vllm_omni_plugin.stage_configs")))
    except (ModuleNotFoundError, TypeError):
        return Path(__file__).resolve().parents[2] / "stage_configs"


def find_config_file(name: str | Path) -> Path:
    """A path as given, else a bundled config by name (`glm_image` -> stage_configs/glm_image.yaml)."""
    path = Path(name).expanduser()
    if path.exists() or path.suffix or len(path.parts) > 1:
        return path
    for folder in (bundled_dir(), Path(__file__).resolve().parents[2] / "stage_configs"):
        candidate = folder / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    return path


def read_yaml(path: Path, sink: ProblemSink) -> dict[str, Any] | None:
    """Parse one YAML file into a mapping; syntax errors are reported with their line."""
    try:
        text = path.read_text()
    except OSError as exc:
        sink.add(None, "", f"cannot read the file: {exc.strerror or exc}")
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "yaml"
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        col = f", column {mark.column + 1}" if mark is not None else ""
        sink.add(None, where, f"YAML syntax error{col}: {what}")
        return None
    if data is None:
        sink.add(None, "", "the file is empty; a deploy config is a mapping with a `stages` list")
        return None
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else type(data).__name__
        sink.add(None, "", f"the top level must be a mapping (pipeline:, stages:, ...), got {kind}")
        return None
    return data


def resolve_interpolations(data: dict[str, Any], sink: ProblemSink) -> LoadedFile | None:
    """Resolve `${...}` leaf by leaf; each failure becomes a problem naming its field."""
    try:
        _install_tolerant_decode()
        cfg = OmegaConf.create(data)
    except Exception as exc:  # e.g. keys OmegaConf cannot hold
        sink.add(None, "", f"cannot build the config: {exc}")
        return None
    env_refs: dict[Path_, list[str]] = {}
    before = len(sink.problems)
    resolved = _resolve_node(cfg, (), sink, env_refs, data)
    if len(sink.problems) > before:
        return None
    return LoadedFile(Path(), resolved, env_refs)


def _resolve_node(node: Any, path: Path_, sink: ProblemSink, env_refs: dict, raw: Any) -> Any:
    if isinstance(node, DictConfig):
        keys = list(node.keys())
        out: dict[Any, Any] = {}
        for key in keys:
            out[key] = _resolve_child(node, key, path + (key,), sink, env_refs, raw)
        return out
    if isinstance(node, ListConfig):
        return [_resolve_child(node, i, path + (i,), sink, env_refs, raw) for i in range(len(node))]
    return node


def _resolve_child(parent: Any, key: Any, path: Path_, sink: ProblemSink, env_refs, raw) -> Any:
    child = parent._get_node(key)
    raw_value = child._value() if child is not None else None
    if isinstance(raw_value, str) and "${" in raw_value:
        names = _ENV_REF.findall(raw_value)
        if names:
            env_refs[path] = names
    try:
        value = parent[key]
    except Exception as exc:
        sink.add(_stage_of(path, raw), _dotted(path), _interp_message(exc, raw_value))
        return None
    return _resolve_node(value, path, sink, env_refs, raw)


def _interp_message(exc: Exception, raw_value: Any) -> str:
    text = str(exc)
    missing = _MISSING_ENV.search(text)
    if missing:
        var = missing.group(1)
        return (
            f"environment variable {var} is not set and `{raw_value}` gives no default "
            f"(set {var}, or write ${{oc.env:{var},DEFAULT}})"
        )
    first = text.splitlines()[0] if text else type(exc).__name__
    return f"cannot resolve `{raw_value}`: {first}"


def _stage_of(path: Path_, raw: Any) -> int | None:
    """The stage id a leaf path falls under (`stages[i]` / `stage_args[i]`), if any."""
    if len(path) >= 2 and path[0] in ("stages", "stage_args") and isinstance(path[1], int):
        try:
            sid = raw[path[0]][path[1]].get("stage_id")
            return sid if isinstance(sid, int) else None
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return None


def _dotted(path: Path_) -> str:
    # The stage is named separately in the error line, so drop the `stages[i]` prefix.
    if len(path) >= 2 and path[0] in ("stages", "stage_args") and isinstance(path[1], int):
        path = path[2:]
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def load_file(path: Path, sink: ProblemSink) -> LoadedFile | None:
    """Read and interpolate one file (without following `base_config`)."""
    data = read_yaml(path, sink)
    if data is None:
        return None
    loaded = resolve_interpolations(data, sink)
    if loaded is not None:
        loaded.path = path
    return loaded


def load_with_bases(
    path: Path, sink: ProblemSink, _seen: tuple[Path, ...] = ()
) -> list[LoadedFile]:
    """The file and the chain of files it inherits through `base_config`, base first."""
    resolved = path.resolve()
    if resolved in _seen:
        sink.add(None, "base_config", f"inheritance loop through {path.name}")
        return []
    loaded = load_file(path, sink)
    if loaded is None:
        return []
    base = loaded.data.get("base_config")
    if base is None:
        return [loaded]
    if not isinstance(base, str) or not base:
        sink.add(None, "base_config", "must be a file name or path (a string)")
        return [loaded]
    base_path = Path(base).expanduser()
    if not base_path.is_absolute():
        base_path = path.parent / base_path
    if not base_path.exists():
        bundled = find_config_file(Path(base).stem)
        if bundled.exists():
            base_path = bundled
        else:
            sink.add(None, "base_config", f"file {base} not found (looked in {path.parent})")
            return [loaded]
    return load_with_bases(base_path, sink, _seen + (resolved,)) + [loaded]
