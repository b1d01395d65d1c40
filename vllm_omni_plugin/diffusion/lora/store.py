"""The LoRA adapters of one diffusion engine: checking, the resident set, each forward's plan.

* `check` (request validation): each adapter folder resolved inside `lora.dir` and its header
  checked against the transformer (common/lora_files.py); nothing is loaded.
* `acquire` (admission, scheduler hook): the request's adapters made resident on the device and
  pinned while it runs. At most `max_loaded` adapters are resident; an unpinned one is evicted
  least recently used first. A request whose adapters cannot all be made resident now (every
  slot pinned by running requests) waits in the queue; `release` unpins when it leaves.
* `rows` (each transformer forward): the plan the wrapped linears read (layers.py), with the
  weights of the expert that forward runs (Wan2.2: `transformer`, then `transformer_2`; an
  adapter without weights for that expert leaves its rows plain there).

Resident adapters are keyed by folder and file stamp, so an adapter replaced on disk (or
unloaded and loaded again from changed files) is loaded afresh.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...common.lora_files import AdapterFile, LoraError, load_tensors, read_adapter, resolve_folder
from ...common.lora_request import LoraRef
from .layers import AdapterRows, RowPlan, install


@dataclass(frozen=True)
class CheckedLora:
    """A request's adapter after `check`: its ref (name, scale) and its checked file."""

    ref: LoraRef
    file: AdapterFile

    @property
    def key(self) -> tuple[str, tuple]:
        return str(self.file.folder), self.file.stamp


@dataclass(eq=False)
class Resident:
    key: tuple[str, tuple]
    # per expert: module -> (lora_A, lora_B, scaling); empty where it adapts not that expert
    weights: tuple[dict[str, tuple[torch.Tensor, torch.Tensor, float]], ...]
    pins: int = 0


class LoraStore:
    """`models`: the transformers adapters adapt, in expert order (one, or Wan2.2's two)."""

    def __init__(
        self,
        models: list[torch.nn.Module],
        prefixes: tuple[str, ...],
        *,
        root: str,
        max_loaded: int,
        max_rank: int,
        family: str,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.root = str(Path(root).resolve())
        self.max_loaded = max_loaded
        self.max_rank = max_rank
        self.family = family
        self.device = device
        self.dtype = dtype
        self.plan: RowPlan | None = None
        # Each expert's wrapped linears read the same plan: one forward runs one expert.
        self.expert_targets = [install(m, prefixes, self) for m in models]
        self.targets = self.expert_targets[0]
        self._resident: OrderedDict[tuple[str, tuple], Resident] = OrderedDict()
        self._pinned: dict[str, list[Resident]] = {}
        self._lock = threading.Lock()
        self._plan_tensors: dict[tuple, torch.Tensor] = {}
        self.loads = 0  # adapters moved to the device since start (each eviction costs one)

    def facts(self) -> dict[str, Any]:
        """What the API server checks adapters and requests against (StageInfo.lora)."""
        out = {
            "dir": self.root,
            "max_loaded": self.max_loaded,
            "max_rank": self.max_rank,
            "family": self.family,
            "targets": {k: list(v) for k, v in self.targets.items()},
        }
        if self.second_targets is not None:
            out["targets_2"] = {k: list(v) for k, v in self.second_targets.items()}
        return out

    @property
    def second_targets(self) -> dict[str, tuple[int, int]] | None:
        """The second expert's target linears (Wan2.2's `transformer_2`), None with one."""
        return self.expert_targets[1] if len(self.expert_targets) > 1 else None

    # ---- requests ----------------------------------------------------------------------
    def check(self, items: list[tuple[LoraRef, str]]) -> tuple[CheckedLora, ...]:
        """(ref, folder path relative to the adapter directory) per adapter -> checked."""
        if len(items) > self.max_loaded:
            raise LoraError(
                f"{len(items)} adapters in one request exceed lora.max_loaded={self.max_loaded}"
            )
        out = []
        for ref, path in items:
            folder = resolve_folder(self.root, path)
            out.append(
                CheckedLora(
                    ref,
                    read_adapter(
                        folder, self.targets, self.max_rank, self.family, self.second_targets
                    ),
                )
            )
        return tuple(out)

    def acquire(
        self, request_id: str, adapters: tuple[CheckedLora, ...]
    ) -> list[tuple[Resident, float]] | None:
        """Make the request's adapters resident and pin them; None: no room now (wait)."""
        with self._lock:
            need = [a for a in adapters if a.key not in self._resident]
            free = self.max_loaded - len(self._resident)
            evictable = [
                r
                for r in self._resident.values()
                if r.pins == 0 and r.key not in {a.key for a in adapters}
            ]
            if len(need) > free + len(evictable):
                return None
            for r in evictable[: max(0, len(need) - free)]:  # least recently used first
                del self._resident[r.key]
            for a in need:
                weights = load_tensors(a.file, self.device, self.dtype)
                self._resident[a.key] = Resident(a.key, weights)
                self.loads += 1
            held = []
            for a in adapters:
                r = self._resident[a.key]
                self._resident.move_to_end(a.key)
                r.pins += 1
                held.append((r, a.ref.scale))
            self._pinned[request_id] = [r for r, _ in held]
            return held

    def release(self, request_id: str) -> None:
        with self._lock:
            for r in self._pinned.pop(request_id, []):
                r.pins -= 1

    def resident(self) -> list[str]:
        """Folders of the adapters on the device, least recently used first."""
        with self._lock:
            return [Path(k[0]).name for k in self._resident]

    # ---- forwards ----------------------------------------------------------------------
    def _on_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small per-forward tensor, copied without waiting for the device's queue (a
        plain host-to-device copy of pageable memory would block on every kernel before it)."""
        key = (tuple(values), dtype)
        found = self._plan_tensors.get(key)
        if found is None:
            pinned = self.device.type == "cuda"
            host = torch.tensor(values, dtype=dtype, pin_memory=pinned)
            found = host.to(self.device, non_blocking=pinned)
            if len(self._plan_tensors) >= 256:
                self._plan_tensors.pop(next(iter(self._plan_tensors)))
            self._plan_tensors[key] = found
        return found

    @contextmanager
    def rows(self, rows: list[tuple[Any, Any, int]], expert: int = 0) -> Iterator[None]:
        """The plan of one forward of `expert` (0: `transformer`, 1: `transformer_2`): `rows`
        are its row groups in batch order, (request state, tag, rows); a state's `lora` holds
        its pinned (Resident, scale) pairs."""
        groups: dict[int, tuple[Resident, list[int], list[float]]] = {}
        lo = 0
        for state, _tag, n in rows:
            for resident, scale in getattr(state, "lora", None) or ():
                if not resident.weights[expert]:
                    continue  # this adapter adapts not this expert
                entry = groups.setdefault(id(resident), (resident, [], []))
                entry[1].extend(range(lo, lo + n))
                entry[2].extend([scale] * n)
            lo += n
        if not groups:
            yield
            return
        plan = RowPlan(lo, [])
        for resident, index, scales in groups.values():
            contiguous = index == list(range(index[0], index[0] + len(index)))
            uniform = all(s == scales[0] for s in scales)
            plan.groups.append(
                AdapterRows(
                    resident.weights[expert],
                    None if contiguous else self._on_device(index, torch.long),
                    float(scales[0]) if uniform else self._on_device(scales, torch.float32),
                    (index[0], index[-1] + 1) if contiguous else None,
                )
            )
        self.plan = plan
        try:
            yield
        finally:
            self.plan = None
