"""What one request keeps between steps for its step cache: per row group, the residuals and
references its policy needs; per step, the one decision all its rows follow."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.cache_policy import CachePolicy

PRIMARY = "cond"  # the tag whose rows decide for the whole request (CFG rows decide together)


@dataclass(eq=False)
class SlotCache:
    """One row group of a request (its cond rows, its uncond rows) on one expert."""

    # first_block: the head block's residual at the last computed step (the reference the
    # current residual is compared with) and the residual of the blocks after the head.
    head_residual: torch.Tensor | None = None
    tail_residual: tuple[torch.Tensor | None, ...] | None = None
    # teacache: the residual of the whole block stack and the last modulated input.
    stack_residual: tuple[torch.Tensor | None, ...] | None = None
    modulated: torch.Tensor | None = None
    accumulated: float = 0.0
    # taylorseer: Taylor factors of the transformer output and the step they were taken at.
    factors: list[torch.Tensor] = field(default_factory=list)
    updated_at: int | None = None
    dtype: torch.dtype = torch.float32  # the transformer output's dtype (forecasts use it)


@dataclass(eq=False)  # identity: it holds tensors
class RequestCache:
    """A request's step-cache state; `begin` is called before each of its forwards."""

    policy: CachePolicy
    expert: Hashable = None
    expert_start: int = 0
    step: int = -1
    total_steps: int = 0
    compute: bool | None = None  # this step's decision (None: not decided yet)
    skipped: int = 0  # steps whose transformer call was skipped (or shortened to its head)
    slots: dict[Hashable, SlotCache] = field(default_factory=dict)
    pending: dict[str, Any] = field(default_factory=dict)

    def begin(self, step: int, total_steps: int, expert: Hashable) -> None:
        if expert != self.expert:  # a new expert (Wan2.2): its caches start empty
            self.slots.clear()
            self.expert, self.expert_start = expert, step
        if step != self.step:
            self.step, self.total_steps, self.compute = step, total_steps, None
            self.pending.clear()

    @property
    def local_step(self) -> int:
        """Steps since this expert took over (the step counter diffusers' hooks keep)."""
        return self.step - self.expert_start

    def slot(self, tag: Hashable) -> SlotCache:
        return self.slots.setdefault(tag, SlotCache())

    def decide(self, compute: bool) -> None:
        self.compute = compute
        if not compute:
            self.skipped += 1
