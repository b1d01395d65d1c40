"""Qwen-Image's transformer forward over a padded text batch, without a host-to-device copy.

When prompts of different lengths share a forward (batch > 1), the Qwen-Image adapter pads the
text and passes `encoder_hidden_states_mask`. diffusers 0.42's
`QwenImageTransformer2DModel.forward` then calls `compute_text_seq_len_from_mask`, which builds
`torch.as_tensor(text_seq_len, device=...)`: a Python int copied from pageable host memory to
the GPU on every forward. Outside a graph that copy is small but synchronous; inside a CUDA
graph capture it is an error ("Cannot copy between CPU and CUDA tensors during CUDA graph
capture unless the CPU tensor is pinned"), so on the H200 every padded batch shape (Qwen-Image
at batch 8) ran uncaptured. The forward drops that tensor (the per-sample lengths) anyway:
what its blocks use is the mask as bool, and its RoPE length comes from the text's shape.

`install` gives every transformer block a forward pre-hook, ahead of any other (e.g. Ulysses'
cut of the mask), that supplies the block's `encoder_hidden_states_mask` from a holder when the
forward passed none. `SyncFreeQwen` wraps the call: it casts the mask to bool on the device,
puts it in the holder and calls the forward without it, so the forward skips the mask path and
each block receives the very mask the forward would have handed it: the same math, bit for bit.
Under a CUDA graph the cast reads the graph's static mask buffer, so a replay with another
batch's mask (copied into that buffer) masks that batch.

Not covered: the Qwen-Image-Edit transformers with `zero_cond_t` build their `modulate_index`
with `torch.tensor(..., device=...)` in every forward (another host copy; those shapes still
run uncaptured).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

MODEL = "QwenImageTransformer2DModel"
MASK = "encoder_hidden_states_mask"
_HOLDER = "_omni_text_mask"  # the transformer's attribute holding the call's mask


class MaskHolder:
    """The bool text mask of the forward in progress (None between calls), and the blocks that
    read it."""

    def __init__(self, blocks: tuple[nn.Module, ...]) -> None:
        self.mask: torch.Tensor | None = None
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
    """Add the blocks' mask hooks (Qwen-Image transformers only); returns the undo, or None."""
    if type(transformer).__name__ != MODEL or holder(transformer) is not None:
        return None
    box = MaskHolder(tuple(transformer.transformer_blocks))

    def supply_mask(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if box.mask is None or kwargs.get(MASK) is not None:
            return None
        return args, {**kwargs, MASK: box.mask}

    handles = [
        block.register_forward_pre_hook(supply_mask, with_kwargs=True, prepend=True)
        for block in transformer.transformer_blocks
    ]
    transformer.__dict__[_HOLDER] = box

    def undo() -> None:
        for handle in handles:
            handle.remove()
        transformer.__dict__.pop(_HOLDER, None)

    return undo


class SyncFreeQwen:
    """Calls `fn` (the Qwen-Image transformer, compiled or not) with its text mask going to the
    blocks through the holder instead of through the forward's mask path."""

    def __init__(self, fn: Callable[..., Any], transformer: nn.Module) -> None:
        self.fn = fn
        box = holder(transformer)
        if box is None:
            raise TypeError("qwen_image_sync_free.install(transformer) must run first")
        self._holder = box
        self._transformer = transformer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mask = kwargs.get(MASK)
        if args or not isinstance(mask, torch.Tensor):
            return self.fn(*args, **kwargs)
        if not self._holder.in_place(self._transformer):
            return self.fn(**kwargs)
        text = kwargs.get("encoder_hidden_states")
        if text is not None and tuple(mask.shape[:2]) != tuple(text.shape[:2]):
            # diffusers' own check, which the forward no longer reaches
            raise ValueError(
                f"`{MASK}` shape {tuple(mask.shape)} must match (batch_size, text_seq_len)="
                f"{tuple(text.shape[:2])}."
            )
        self._holder.mask = mask if mask.dtype == torch.bool else mask.to(torch.bool)
        try:
            return self.fn(**{**kwargs, MASK: None})
        finally:
            self._holder.mask = None

    def __getattr__(self, name: str) -> Any:  # config, dtype, ... of the wrapped module
        if name == "fn":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)
