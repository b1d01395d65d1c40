"""The talker's KV cache: one slot per decoding request, in one tensor per layer, so a batched
decode step writes and reads every request's keys with a few indexed ops (no per-request loop,
no host sync) and its shapes stay fixed between steps (what a CUDA graph needs).

    cache = SlotKVCache(num_layers=20, slots=64, kv_heads=2, head_dim=128, dtype, device)
    slot = cache.acquire()            # a request starts (prefill)
    cache.reserve(length + 1)         # before a step that writes position `length`
    cache.release(slot)               # it ends; the slot's old keys stay until overwritten
"""

from __future__ import annotations

import torch


class TalkerCacheFull(RuntimeError):
    """Every slot is taken: a request waits for one before its prefill."""


class SlotKVCache:
    """Keys and values `[num_layers, slots + 1, kv_heads, capacity, head_dim]`; the last slot
    is scratch, written by the padding rows of a batch. Zero-filled, and positions past a
    request's length are masked: they must hold finite values (0 x NaN is NaN in attention's
    weighted sum). `capacity` doubles when a request outgrows it, up to `limit` (`generation`
    counts the reallocations: tensors captured before one are stale)."""

    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int = 512,
        limit: int | None = None,
    ):
        if slots < 1 or capacity < 1:
            raise ValueError("slots and capacity must be >= 1")
        self.limit = limit  # most positions a slot may hold (None: no bound)
        if limit is not None:
            capacity = min(capacity, limit)
        self.slots = slots
        self.scratch = slots
        self._shape = (num_layers, slots + 1, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(self._shape, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.generation = 0
        self._free = list(range(slots - 1, -1, -1))

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise TalkerCacheFull(f"all {self.slots} talker cache slots are in use")
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def reserve(self, length: int) -> bool:
        """Room for `length` positions in every slot; True when the tensors were reallocated."""
        if length <= self.capacity:
            return False
        if self.limit is not None and length > self.limit:
            raise ValueError(f"{length} positions exceed the cache's limit of {self.limit}")
        capacity = self.capacity
        while capacity < length:
            capacity *= 2
        if self.limit is not None:
            capacity = min(capacity, self.limit)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], capacity, old.shape[4])
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)
        self.generation += 1
        return True
