"""Layered merging that remembers, for every leaf, which layer set it.

Layers, lowest to highest precedence (later wins):
schema `default` < `yaml` (a `base_config` file is `yaml:<file>`) < `platform:<name>` <
`pipeline` (pipeline-wide top-level fields) < `topology` < `strategy` < `cli` < `stage-overrides`.
A value interpolated from environment variables is labelled `<layer>+env:<VAR>`; a value the
resolver computes from others is labelled `derived:<from>`.
"""

from __future__ import annotations

import copy
from typing import Any

LAYER_ORDER = (
    "default",
    "yaml",
    "platform",
    "pipeline",
    "topology",
    "strategy",
    "cli",
    "stage-overrides",
)

# Mappings an override replaces whole instead of merging (vLLM-Omni semantics).
REPLACE_WHOLE = frozenset({"omni_kv_config"})


class Layered:
    """A mapping built from layers, with a provenance entry per leaf (dotted path)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.provenance: dict[str, str] = {}

    def apply(
        self, layer: str, values: dict[str, Any], env_paths: dict[str, list[str]] | None = None
    ) -> None:
        """Deep-merge `values` on top, recording `layer` (with env vars) for each leaf set."""
        _merge(self.data, values, layer, "", self.provenance, env_paths or {})

    def set(self, key: str, value: Any, layer: str) -> None:
        _drop_prefix(self.provenance, key)
        self.data[key] = value
        _mark(self.provenance, key, value, layer, {})


def _merge(target: dict, values: dict, layer: str, prefix: str, prov: dict, env: dict) -> None:
    for key, value in values.items():
        path = f"{prefix}{key}"
        current = target.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and key not in REPLACE_WHOLE:
            _merge(current, value, layer, path + ".", prov, env)
        else:
            _drop_prefix(prov, path)
            target[key] = copy.deepcopy(value)
            _mark(prov, path, value, layer, env)


def _mark(prov: dict, path: str, value: Any, layer: str, env: dict) -> None:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _mark(prov, f"{path}.{key}", sub, layer, env)
        return
    names = env.get(path)
    prov[path] = f"{layer}+env:{','.join(names)}" if names else layer


def _drop_prefix(prov: dict, path: str) -> None:
    for key in [k for k in prov if k == path or k.startswith(path + ".")]:
        del prov[key]


def leaf_provenance(prov: dict[str, str], prefix: str) -> dict[str, str]:
    """Entries at or under `prefix` (e.g. a section's)."""
    return {k: v for k, v in prov.items() if k == prefix or k.startswith(prefix + ".")}
