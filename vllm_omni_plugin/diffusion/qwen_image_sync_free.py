"""Qwen-Image family transformer forwards without a host-to-device copy.

Two of diffusers 0.42's `QwenImageTransformer2DModel.forward` paths copy host data to the
device on every call. Outside a graph such a copy is small but synchronous; inside a CUDA graph
capture it is an error ("Cannot copy between CPU and CUDA tensors during CUDA graph capture
unless the CPU tensor is pinned"), so on the H200 those shapes ran uncaptured:

  * a padded text batch (batch > 1, prompts of different lengths: the adapter passes
    `encoder_hidden_states_mask`) goes through `compute_text_seq_len_from_mask`, which builds
    `torch.as_tensor(text_seq_len, device=...)`. The forward drops that tensor (the per-sample
    lengths) anyway: its blocks use the mask as bool, its RoPE length is the text's shape.
  * a `zero_cond_t` transformer (Qwen-Image-Edit-2511: the source images' tokens modulated at
    timestep 0) builds its `modulate_index` (0 for each row's output tokens, 1 for its source
    images' tokens) with `torch.tensor(<nested list>, device=...)`.

`install` gives every transformer block a forward pre-hook, ahead of any other (e.g. Ulysses'
cut of the mask), that supplies the block's `encoder_hidden_states_mask` and `modulate_index`
from a holder when the forward passed none, and (zero_cond_t) one on `norm_out` that takes the
first half of its conditioning, as the forward does before it. `SyncFreeQwen` wraps the call:
it casts the mask to bool on the device and builds the modulate index from device fills (one
per row: no host data), puts them in the holder and calls the forward without them, with
`zero_cond_t` off for that call and the timesteps already doubled (`[t, 0 * t]`, what the
forward would build), so the forward skips both copies and each block receives the very
tensors the forward would have handed it: the same math, bit for bit. Under a CUDA graph the
cast reads the graph's static mask buffer, so a replay with another batch's mask (copied into
that buffer) masks that batch; the modulate index depends only on `img_shapes`, which is part
of the graph's signature.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

import torch
from torch import nn

MODEL = "QwenImageTransformer2DModel"
MASK = "encoder_hidden_states_mask"
INDEX = "modulate_index"
_HOLDER = "_omni_text_mask"  # the transformer's attribute holding the call's tensors


class MaskHolder:
    """The bool text mask and the modulate index of the forward in progress (None between
    calls and when the call has none), and the blocks that read them."""

    def __init__(self, blocks: tuple[nn.Module, ...]) -> None:
        self.mask: torch.Tensor | None = None
        self.modulate_index: torch.Tensor | None = None
        self.blocks = blocks

    def in_place(self, transformer: nn.Module) -> bool:
        """Whether the hooked blocks still are the transformer's blocks. The step cache puts
        its row-selecting wrappers in their place (step_cache/blocks.py): a whole-batch mask
        from the holder would then meet a subset of the rows, so the mask takes diffusers'
        own path (the step cache never runs under a CUDA graph)."""
        current = transformer.transformer_blocks
        return len(current) == len(self.blocks) and all(
            a is b for a, b in zip(current, self.blocks, strict=True)
        )


def holder(transformer: nn.Module) -> MaskHolder | None:
    """The installed holder of `transformer`, None when `install` did not run on it."""
    return transformer.__dict__.get(_HOLDER)


def install(transformer: nn.Module) -> Callable[[], None] | None:
    """Add the blocks' hooks (Qwen-Image transformers only); returns the undo, or None."""
    if type(transformer).__name__ != MODEL or holder(transformer) is not None:
        return None
    box = MaskHolder(tuple(transformer.transformer_blocks))

    def supply(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        extra = {}
        if box.mask is not None and kwargs.get(MASK) is None:
            extra[MASK] = box.mask
        if box.modulate_index is not None and kwargs.get(INDEX) is None:
            extra[INDEX] = box.modulate_index
        return (args, {**kwargs, **extra}) if extra else None

    def first_half_of_temb(module: nn.Module, args: tuple) -> tuple | None:
        # what the forward's `if self.zero_cond_t: temb = temb.chunk(2, dim=0)[0]` does
        if box.modulate_index is None:
            return None
        x, temb, *rest = args
        return (x, temb.chunk(2, dim=0)[0], *rest)

    handles = [
        block.register_forward_pre_hook(supply, with_kwargs=True, prepend=True)
        for block in transformer.transformer_blocks
    ]
    handles.append(transformer.norm_out.register_forward_pre_hook(first_half_of_temb))
    transformer.__dict__[_HOLDER] = box

    def undo() -> None:
        for handle in handles:
            handle.remove()
        transformer.__dict__.pop(_HOLDER, None)

    return undo


def modulate_index(img_shapes: list, device: torch.device) -> torch.Tensor:
    """diffusers' zero_cond_t `modulate_index` (int32, one row per sample: 0 over the output
    frame's tokens, 1 over the source images'), built by fills on `device`."""
    rows = []
    for sample in img_shapes:
        own, sources = prod(sample[0]), sum(prod(s) for s in sample[1:])
        rows.append(
            torch.cat(
                [
                    torch.zeros(own, dtype=torch.int, device=device),
                    torch.ones(sources, dtype=torch.int, device=device),
                ]
            )
        )
    return torch.stack(rows)


class SyncFreeQwen:
    """Calls `fn` (the Qwen-Image transformer, compiled or not) with its text mask and
    modulate index going to the blocks through the holder instead of through the forward's
    copying paths."""

    def __init__(self, fn: Callable[..., Any], transformer: nn.Module) -> None:
        self.fn = fn
        box = holder(transformer)
        if box is None:
            raise TypeError("qwen_image_sync_free.install(transformer) must run first")
        self._holder = box
        self._transformer = transformer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get(MASK)
        has_mask = isinstance(mask, torch.Tensor)
        zero_cond_t = bool(getattr(self._transformer, "zero_cond_t", False))
        if args or not (has_mask or zero_cond_t) or not self._holder.in_place(self._transformer):
            return self.fn(*args, **kwargs)
        call = dict(kwargs)
        if has_mask:
            text = kwargs.get("encoder_hidden_states")
            if text is not None and tuple(mask.shape[:2]) != tuple(text.shape[:2]):
                # diffusers' own check, which the forward no longer reaches
                raise ValueError(
                    f"`{MASK}` shape {tuple(mask.shape)} must match (batch_size, "
                    f"text_seq_len)={tuple(text.shape[:2])}."
                )
            self._holder.mask = mask if mask.dtype == torch.bool else mask.to(torch.bool)
            call[MASK] = None
        if zero_cond_t:
            timestep = kwargs["timestep"]
            self._holder.modulate_index = modulate_index(kwargs["img_shapes"], timestep.device)
            call["timestep"] = torch.cat([timestep, timestep * 0], dim=0)
            self._transformer.zero_cond_t = False
        try:
            return self.fn(**call)
        finally:
            self._holder.mask = None
            self._holder.modulate_index = None
            if zero_cond_t:
                self._transformer.zero_cond_t = True

    def __getattr__(self, name: str) -> Any:  # config, dtype, ... of the wrapped module
        if name == "fn":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)
