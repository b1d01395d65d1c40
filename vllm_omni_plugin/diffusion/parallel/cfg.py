"""CFG parallelism: a step's rows (cond rows, then uncond rows) split over the two ranks of a
CFG group, each running its half through the transformer, the predictions gathered back in row
order so the family's own CFG combine runs unchanged on every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .comm import gather_pieces, split_sizes, take_piece
from .layout import ParallelLayout

# Transformer arguments with one entry per row, by transformer class (the rest, such as FLUX's
# txt_ids/img_ids, are shared by all rows).
ROW_ARGS: dict[str, tuple[str, ...]] = {
    "FluxTransformer2DModel": (
        "hidden_states",
        "timestep",
        "guidance",
        "pooled_projections",
        "encoder_hidden_states",
    ),
    "QwenImageTransformer2DModel": (
        "hidden_states",
        "timestep",
        "guidance",
        "encoder_hidden_states_mask",
        "encoder_hidden_states",
        "img_shapes",
    ),
    "GlmImageTransformer2DModel": (
        "hidden_states",
        "encoder_hidden_states",
        "prior_token_id",
        "prior_token_drop",
        "timestep",
        "target_size",
        "crop_coords",
    ),
}


class RowSplitTransformer:
    """Stands in for `adapter.transformer`: each CFG rank runs its share of the rows."""

    def __init__(self, inner: Any, layout: ParallelLayout, class_name: str) -> None:
        if class_name not in ROW_ARGS:
            raise ValueError(f"cfg_parallel: no row plan for {class_name} ({sorted(ROW_ARGS)})")
        self.inner = inner
        self.layout = layout
        self.row_args = ROW_ARGS[class_name]
        self.split = True  # off while whole row groups are spread instead (spread_groups)
        self.splits = 0  # forwards run split over the CFG ranks, and row groups spread (tests)
        self.spreads = 0

    def __getattr__(self, name: str) -> Any:  # config, dtype, ... of the real transformer
        return getattr(self.inner, name)

    def __call__(self, **kwargs: Any) -> Any:
        if kwargs.get("kv_caches") is not None:
            # GLM-Image edits attend to cached source-image keys, which neither the row split
            # nor the Ulysses token split cuts yet: fail the request rather than its image.
            raise NotImplementedError("image edits do not run with cfg_parallel/ulysses_degree")
        rows = kwargs["hidden_states"].shape[0]
        lay = self.layout
        if not self.split or lay.cfg_degree == 1 or rows < lay.cfg_degree:
            return self.inner(**kwargs)  # one row: every rank runs it (nothing to split)
        sizes = split_sizes(rows, lay.cfg_degree)
        self.splits += 1
        mine = dict(kwargs)
        for name in self.row_args:
            value = kwargs.get(name)
            if isinstance(value, torch.Tensor):
                mine[name] = take_piece(value, 0, sizes, lay.cfg_rank)
            elif isinstance(value, list):
                start = sum(sizes[: lay.cfg_rank])
                mine[name] = value[start : start + sizes[lay.cfg_rank]]
        out = self.inner(**mine)
        pred = out[0] if isinstance(out, tuple) else out.sample
        full = gather_pieces(pred.contiguous(), 0, sizes, lay.cfg_group, lay.cfg_rank)
        return (full,)


def spread_groups(
    layout: ParallelLayout, transformer: RowSplitTransformer
) -> Callable[[Callable[[Any], torch.Tensor], list[Any]], list[torch.Tensor]]:
    """`adapter.forward_groups` for families that run several forwards per step (GLM-Image:
    its uncond rows have another text length): with as many groups as CFG ranks or more, group
    i runs on CFG rank i % 2 and its output is sent to the other rank."""

    def forward_groups(forward: Callable[[Any], torch.Tensor], groups: list[Any]) -> list:
        if layout.cfg_degree == 1 or len(groups) < layout.cfg_degree:
            return [forward(g) for g in groups]
        outs: list[torch.Tensor | None] = [None] * len(groups)
        transformer.spreads += 1
        transformer.split = False
        try:
            for i, g in enumerate(groups):
                if i % layout.cfg_degree == layout.cfg_rank:
                    outs[i] = forward(g)
        finally:
            transformer.split = True
        peers = layout.cfg_peers()
        for i in range(len(groups)):
            outs[i] = _broadcast(outs[i], peers[i % layout.cfg_degree], layout.cfg_group)
        return outs

    return forward_groups


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _broadcast(x: torch.Tensor | None, src: int, group: Any) -> torch.Tensor:
    """Tensor of any shape from global rank `src` to its group (a header says its shape)."""
    device = x.device if x is not None else _group_device(group)
    header = torch.full((9,), -1, dtype=torch.long, device=device)
    if x is not None:
        header[0] = _DTYPES.index(x.dtype)
        header[1 : 1 + x.dim()] = torch.tensor(x.shape)
    dist.broadcast(header, src, group=group)
    shape = [int(v) for v in header[1:].tolist() if v >= 0]
    if x is None:
        x = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    dist.broadcast(x.contiguous(), src, group=group)
    return x


def _group_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
