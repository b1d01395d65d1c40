"""GLM-Image's rotary positions for text-to-image, in a form stock vLLM can carry.

transformers (`GlmImageModel.get_rope_index`) gives the prompt plain text positions 0..L-1 on
all three M-RoPE axes (t, h, w). The generated tokens get grid positions instead: for each target
grid, decoded last-grid-first (preview grid, then the large grid), the token at row r, column c
gets (t, h, w) = (s, s + r, s + c), where s starts at L and moves on by max(rows, cols) after each
grid; every token after the grids gets (e, e, e) with e the final s.

Stock vLLM computes decode-time M-RoPE positions itself, linearly: delta + token index, the same
on all three axes, with one int32-sized `delta` per request that the model chooses at prefill.
So the model picks delta to make that linear value an *address*: `stride * (slot + 1) + k`,
where k is the index of the generated token and `slot` names a row of a small table (on the
model's device) holding the request's prompt length and grid shapes. `forward` decodes every
position >= stride back into true (t, h, w) positions; prompt positions (< max_model_len <=
stride) pass through. Decoding is elementwise torch, fine under torch.compile and CUDA graphs.

The table is filled in `get_mrope_input_positions`, which every worker (TP/PP rank) runs for
the same requests in the same order, so slots agree across ranks. Identical layouts share a
slot; slots are reused round-robin once the table is full (far more slots than running
requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_GRID_DIM = 127  # tokens per grid side (4064 pixels at 32 px per token)
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class T2ILayout:
    """What the decode-time positions of one request depend on."""

    prompt_len: int
    # Target grids in decode order (rows, cols): the preview grid first, then the large grid.
    grids: tuple[tuple[int, int], ...]
    # Position value the first grid starts at. Text-to-image: the prompt length (None). Image-
    # to-image: smaller, since each source image advances positions by max(rows, cols) only.
    start: int | None = None

    @property
    def base(self) -> int:
        return self.prompt_len if self.start is None else self.start

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt length {self.prompt_len} < 1")
        if not 1 <= len(self.grids) <= 2:
            raise ValueError(f"expected 1 or 2 target grids, got {len(self.grids)}")
        for rows, cols in self.grids:
            if not (0 < rows <= MAX_GRID_DIM and 0 < cols <= MAX_GRID_DIM):
                raise ValueError(f"grid {rows}x{cols} outside 1..{MAX_GRID_DIM} tokens per side")

    @property
    def num_grid_tokens(self) -> int:
        return sum(rows * cols for rows, cols in self.grids)

    def table_row(self) -> list[int]:
        """[start, rows1, cols1, rows2, cols2] (a missing second grid is 0 x 0)."""
        dims = [d for grid in self.grids for d in grid] + [0, 0] * (2 - len(self.grids))
        return [self.base, *dims]


def reference_positions(
    layout: T2ILayout, num_generated: int, prompt: torch.Tensor | None = None
) -> torch.Tensor:
    """[3, L + num_generated] positions exactly as transformers builds them (plain loops).

    `prompt`: the prompt's own [3, L] positions when they are not plain 0..L-1 (image-to-image).
    """
    length = layout.prompt_len
    if prompt is None:
        prompt = torch.arange(length, dtype=torch.long).expand(3, -1)
    cols_t, cols_h, cols_w = (prompt[i].tolist() for i in range(3))
    start = layout.base
    for rows, cols in layout.grids:
        for r in range(rows):
            for c in range(cols):
                cols_t.append(start)
                cols_h.append(start + r)
                cols_w.append(start + c)
        start += max(rows, cols)
    while len(cols_t) < length + num_generated:
        cols_t.append(start)
        cols_h.append(start)
        cols_w.append(start)
    total = length + num_generated
    return torch.tensor([cols_t[:total], cols_h[:total], cols_w[:total]], dtype=torch.long)


class GridPositionCodec:
    """Chooses each request's delta and decodes the resulting positions (see module doc)."""

    def __init__(
        self, max_model_len: int, device: torch.device | str | None = None, slots: int = 8192
    ):
        self.stride = 1 << max(int(max_model_len) - 1, 1).bit_length()  # power of 2 >= max len
        capacity = _INT32_MAX // self.stride - 1
        if capacity < 1:
            raise ValueError(f"max_model_len {max_model_len} too large for GLM-Image positions")
        self.num_slots = min(slots, capacity)
        self.table = torch.zeros(self.num_slots, 5, dtype=torch.long, device=device)
        self._slot_of: dict[T2ILayout, int] = {}
        self._layout_in: list[T2ILayout | None] = [None] * self.num_slots
        self._next = 0

    def delta_for(self, layout: T2ILayout) -> int:
        if layout.prompt_len >= self.stride:
            raise ValueError(f"prompt length {layout.prompt_len} >= {self.stride}")
        slot = self._slot_of.get(layout)
        if slot is None:
            slot = self._next
            self._next = (self._next + 1) % self.num_slots
            if (old := self._layout_in[slot]) is not None:
                del self._slot_of[old]
            self._layout_in[slot] = layout
            self._slot_of[layout] = slot
            self.table[slot] = torch.tensor(layout.table_row(), dtype=torch.long)
        return self.stride * (slot + 1) - layout.prompt_len

    def prompt_positions(
        self, layout: T2ILayout | None, num_tokens: int, prompt: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """Positions of the first `num_tokens` tokens vLLM prefills, and the request's delta.

        `num_tokens` may exceed the prompt length when vLLM re-prefills a request together with
        tokens it already generated; those get their true grid positions directly. `prompt`:
        the prompt's [3, L] positions when they are not plain text positions (source images).
        """
        if layout is None:
            if prompt is not None:
                # No target grid (e.g. vLLM's profiling dummy): later tokens continue linearly.
                extra = torch.arange(num_tokens - prompt.shape[1], dtype=torch.long)
                last = int(prompt.max()) + 1 if prompt.numel() else 0
                out = torch.cat([prompt, (extra + last).expand(3, -1)], dim=1)[:, :num_tokens]
                return out.clone(), last - prompt.shape[1]
            return torch.arange(num_tokens, dtype=torch.long).expand(3, -1).clone(), 0
        extra = max(0, num_tokens - layout.prompt_len)
        positions = reference_positions(layout, extra, prompt)[:, :num_tokens].clone()
        return positions, self.delta_for(layout)

    def decode(self, positions: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """vLLM's M-RoPE positions [3, N] (some addresses) -> true (t, h, w) positions [3, N].

        `table` is `self.table` as the model holds it (a buffer, so compilers see an input).
        """
        if positions.ndim == 1:  # plain text positions: nothing to decode
            return positions
        enc = positions[0]
        is_addr = enc >= self.stride
        slot = (enc // self.stride - 1).clamp(0, self.num_slots - 1)
        k = enc % self.stride
        row = (self.table if table is None else table)[slot]  # [N, 5]
        length, r1, c1, r2, c2 = row.unbind(-1)

        n1 = r1 * c1
        n2 = r2 * c2
        start2 = length + torch.maximum(r1, c1)
        end = start2 + torch.maximum(r2, c2)
        k2 = k - n1
        in1 = k < n1
        in2 = (~in1) & (k2 < n2)
        # clamp keeps the division defined for lanes that are text or have no 2nd grid.
        row1, col1 = k // c1.clamp(min=1), k % c1.clamp(min=1)
        row2, col2 = k2 // c2.clamp(min=1), k2 % c2.clamp(min=1)

        t = torch.where(in1, length, torch.where(in2, start2, end))
        h = torch.where(in1, length + row1, torch.where(in2, start2 + row2, end))
        w = torch.where(in1, length + col1, torch.where(in2, start2 + col2, end))
        return torch.where(is_addr.unsqueeze(0), torch.stack([t, h, w]), positions)
