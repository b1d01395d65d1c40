"""Row bookkeeping of one transformer forward: which rows belong to which request's row group,
and taking a subset of rows out of a forward's (or a block's) batched arguments."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .state import PRIMARY, RequestCache


@dataclass(eq=False)  # identity: groups are looked up in lists of groups
class RowGroup:
    """Rows lo..lo+n of a forward: one request's rows of one tag ("cond", "uncond")."""

    cache: RequestCache | None  # None: no active policy, always computed
    tag: Hashable
    lo: int
    n: int

    @property
    def hi(self) -> int:
        return self.lo + self.n

    @property
    def primary(self) -> bool:
        return self.tag == PRIMARY

    @property
    def policy(self) -> str | None:
        return None if self.cache is None else self.cache.policy.policy


def regroup(groups: list[RowGroup]) -> list[RowGroup]:
    """The same groups packed from row 0 (the rows of a smaller batch, in order)."""
    out, lo = [], 0
    for g in groups:
        out.append(RowGroup(g.cache, g.tag, lo, g.n))
        lo += g.n
    return out


def row_index(groups: list[RowGroup], device: torch.device) -> torch.Tensor:
    rows = [r for g in groups for r in range(g.lo, g.hi)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def take_rows(value: Any, index: torch.Tensor, rows: int, keep: list[int]) -> Any:
    """`value` with only the kept rows when it carries one entry per row (a tensor or list whose
    first dimension is `rows`, or GLM-Image's per-row key/value caches); anything else (shared
    rotary embeddings, flags) unchanged."""
    if isinstance(value, torch.Tensor):
        if value.dim() and value.shape[0] == rows:
            return value.index_select(0, index)
        return value
    if isinstance(value, list) and len(value) == rows:
        return [value[i] for i in keep]
    if hasattr(value, "k_caches") and hasattr(value, "v_caches"):  # one layer's cache
        return _layer_cache(value, index, rows)
    if hasattr(value, "caches") and isinstance(value.caches, list):  # all layers' caches
        copy = object.__new__(type(value))
        copy.__dict__.update(value.__dict__)
        copy.caches = [_layer_cache(c, index, rows) for c in value.caches]
        return copy
    return value


def _layer_cache(cache: Any, index: torch.Tensor, rows: int) -> Any:
    copy = object.__new__(type(cache))
    copy.__dict__.update(cache.__dict__)
    copy.k_caches = [take_rows(k, index, rows, []) for k in cache.k_caches]
    copy.v_caches = [take_rows(v, index, rows, []) for v in cache.v_caches]
    return copy
