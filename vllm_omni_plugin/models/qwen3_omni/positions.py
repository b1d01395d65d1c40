"""The talker's 3-D (M-RoPE) positions, as transformers' talker computes them in `generate`.

Each prefill position has a (temporal, height, width) triple. Text and audio positions count up
with all three equal (M-RoPE is then plain 1-D rope). An image (or video) run of placeholder
tokens spans its merged patch grid instead: temporal index `t * position_id_per_seconds` (times
the video's seconds per grid), height and width the patch's row and column, all offset by the
next free position; the position after the run is one past the largest the run used. Decode
steps go on 1-D from `delta + step position`, `delta` = (largest prefill position + 1) - length.

transformers computes these on the talker's input ids (the user turns' ids, then the assistant
head as tts pads), from the grids of the images and videos of those turns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VisualGrid:
    """One image or video item: its patch grid (before merging) and, for a video, the seconds
    one temporal grid step spans."""

    t: int
    h: int
    w: int
    seconds_per_grid: float = 1.0


def talker_positions(
    ids: list[int],
    grids: list[VisualGrid],
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    position_id_per_seconds: float,
) -> tuple[torch.Tensor, int]:
    """(`[3, len(ids)]` int64 positions, decode delta) of a talker prefill whose ids are `ids`;
    `grids` one per image/video run in `ids`, in order (ValueError when they do not match)."""
    visual = (image_token_id, video_token_id)
    parts: list[torch.Tensor] = []
    nxt = 0
    i = 0
    items = iter(grids)
    while i < len(ids):
        if ids[i] not in visual:
            j = i
            while j < len(ids) and ids[j] not in visual:
                j += 1
            parts.append(torch.arange(nxt, nxt + j - i).expand(3, -1))
            nxt += j - i
            i = j
            continue
        grid = next(items, None)
        if grid is None:
            raise ValueError("more image/video runs in the prompt than items")
        gh, gw = grid.h // spatial_merge_size, grid.w // spatial_merge_size
        n = grid.t * gh * gw
        if ids[i : i + n] != [ids[i]] * n or (i + n < len(ids) and ids[i + n] == ids[i]):
            raise ValueError(f"an image/video run does not span its {grid.t}x{gh}x{gw} grid")
        scale = grid.seconds_per_grid * position_id_per_seconds
        t = (torch.arange(grid.t, dtype=torch.float64) * scale).long()
        block = torch.stack(
            [
                t.repeat_interleave(gh * gw),
                torch.arange(gh).repeat_interleave(gw).repeat(grid.t),
                torch.arange(gw).repeat(grid.t * gh),
            ]
        )
        parts.append(block + nxt)
        nxt = int(block.max()) + nxt + 1
        i += n
    if next(items, None) is not None:
        raise ValueError("more image/video items than runs in the prompt")
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions.to(torch.long), nxt - len(ids)
