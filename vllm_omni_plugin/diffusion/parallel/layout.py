"""Which rank does what: rank = cfg_rank * ulysses_degree + ulysses_rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass
class ParallelLayout:
    cfg_degree: int  # 1 or 2
    ulysses_degree: int
    rank: int
    # Process groups, set by `init_groups` (None where the degree is 1).
    cfg_group: Any = field(default=None, repr=False)
    ulysses_group: Any = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.cfg_degree * self.ulysses_degree

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.ulysses_degree

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_degree

    def cfg_peers(self) -> list[int]:
        """Global ranks of this rank's CFG group (same ulysses_rank), in cfg_rank order."""
        return [c * self.ulysses_degree + self.ulysses_rank for c in range(self.cfg_degree)]

    def ulysses_peers(self) -> list[int]:
        base = self.cfg_rank * self.ulysses_degree
        return list(range(base, base + self.ulysses_degree))

    def init_groups(self) -> None:
        """Create the subgroups; every rank calls this with the same layout (new_group is
        collective over the whole world, even for groups a rank is not in)."""
        cfg_groups = [
            dist.new_group([c * self.ulysses_degree + u for c in range(self.cfg_degree)])
            for u in range(self.ulysses_degree)
        ]
        uly_groups = [
            dist.new_group(list(range(c * self.ulysses_degree, (c + 1) * self.ulysses_degree)))
            for c in range(self.cfg_degree)
        ]
        if self.cfg_degree > 1:
            self.cfg_group = cfg_groups[self.ulysses_rank]
        if self.ulysses_degree > 1:
            self.ulysses_group = uly_groups[self.cfg_rank]
