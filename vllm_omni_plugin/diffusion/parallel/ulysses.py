"""Ulysses sequence parallelism inside one transformer forward.

Each rank of a Ulysses group keeps a piece of the image tokens and a piece of the text tokens
from the embedders to the output projection (every op there is per token, so the piece is all
it needs). Attention is the one place tokens meet: q, k, v go through an all-to-all that trades
the token split for a head split (each rank then attends over the whole sequence with H/U
heads), and the output goes back the same way. The output projection's pieces are gathered.

Where the pieces are cut is per family (`SHARD_PLANS`): forward hooks on the modules that make
the token streams (and their rotary embeddings), so diffusers' own forward runs unchanged. The
all-to-all wraps `F.scaled_dot_product_attention` through a TorchFunctionMode that is active
only while an attention module runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .comm import gather_pieces, heads_to_seq, seq_to_heads, split_sizes, take_piece


@dataclass
class ShardState:
    """Full lengths of the token streams in the forward now running (set by the cut hooks)."""

    degree: int
    index: int
    group: Any
    lengths: dict[str, int] = field(default_factory=dict)
    attention_calls: int = 0  # all-to-all attentions run (tests check the split happened)
    calls_at_start: int = 0

    def sizes(self, stream: str, length: int) -> list[int]:
        known = self.lengths.setdefault(stream, length)
        if known != length:
            raise RuntimeError(f"{stream} stream cut at {length} tokens, earlier at {known}")
        return split_sizes(length, self.degree)

    def cut(self, x: torch.Tensor, stream: str, dim: int) -> torch.Tensor:
        return take_piece(x, dim, self.sizes(stream, x.shape[dim]), self.index)

    def seq_sizes(self) -> list[int]:
        """Tokens each rank holds in a joint (text + image) attention."""
        per = [split_sizes(n, self.degree) for n in self.lengths.values()]
        return [sum(p[i] for p in per) for i in range(self.degree)]


class _UlyssesAttention(TorchFunctionMode):
    def __init__(self, state: ShardState) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attention(*args, **kwargs)

    def _attention(self, query, key, value, attn_mask=None, **kwargs):
        st = self.state
        sizes = st.seq_sizes()
        if query.shape[2] != sizes[st.index]:
            raise RuntimeError(
                f"Ulysses attention got {query.shape[2]} tokens, expected {sizes[st.index]} "
                f"(streams {st.lengths})"
            )
        st.attention_calls += 1
        q, k, v = (seq_to_heads(t, sizes, st.group, st.index) for t in (query, key, value))
        if attn_mask is not None:
            if attn_mask.dim() != 4 or attn_mask.shape[-2] != 1:
                raise RuntimeError("Ulysses attention takes key-padding masks [B, 1, 1, S] only")
            attn_mask = gather_pieces(attn_mask.contiguous(), 3, sizes, st.group, st.index)
        # Inside __torch_function__ the mode is off: this SDPA is the real one.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
        return heads_to_seq(out, sizes, st.group, st.index)


def _cut_output(state: ShardState, stream: str, dim: int) -> Callable:
    def hook(module, args, output):
        return state.cut(output, stream, dim)

    return hook


def _cut_kwargs(state: ShardState, cuts: dict[str, tuple[str, int]]) -> Callable:
    def hook(module, args, kwargs):
        for name, (stream, dim) in cuts.items():
            value = kwargs.get(name)
            if value is not None:
                kwargs[name] = state.cut(value, stream, dim)
        return args, kwargs

    return hook


def _gather_output(state: ShardState, stream: str, dim: int) -> Callable:
    def hook(module, args, output):
        if state.attention_calls == state.calls_at_start:
            # An attention kernel other than F.scaled_dot_product_attention ran: each rank
            # attended over its own tokens only. Refuse rather than return wrong images.
            raise RuntimeError("Ulysses: the forward's attention bypassed the all-to-all SDPA")
        sizes = state.sizes(stream, state.lengths[stream])
        return gather_pieces(output.contiguous(), dim, sizes, state.group, state.index)

    return hook


def _reset(state: ShardState) -> Callable:
    def hook(module, args, kwargs):
        state.lengths.clear()
        state.calls_at_start = state.attention_calls
        return None

    return hook


def _flux(tr: torch.nn.Module, state: ShardState) -> None:
    # The rotary embedding is computed from [txt_ids, img_ids]: cut them like the streams.
    tr.register_forward_pre_hook(
        _cut_kwargs(
            state,
            {
                "encoder_hidden_states": ("text", 1),
                "txt_ids": ("text", 0),
                "hidden_states": ("image", 1),
                "img_ids": ("image", 0),
            },
        ),
        with_kwargs=True,
    )


def _qwen(tr: torch.nn.Module, state: ShardState) -> None:
    if getattr(tr, "zero_cond_t", False):
        raise ValueError("Ulysses: Qwen-Image edit transformers (zero_cond_t) are not supported")
    blocks = tr.transformer_blocks
    # Cut at the first block: the text length (and its rotary positions) is computed from the
    # whole text before that; the text mask is passed whole to every block.
    blocks[0].register_forward_pre_hook(
        _cut_kwargs(state, {"hidden_states": ("image", 1), "encoder_hidden_states": ("text", 1)}),
        with_kwargs=True,
    )
    for block in blocks:
        block.register_forward_pre_hook(
            _cut_kwargs(state, {"encoder_hidden_states_mask": ("text", 1)}), with_kwargs=True
        )

    def cut_rope(module, args, output):
        img, txt = output
        return state.cut(img, "image", 0), state.cut(txt, "text", 0)

    tr.pos_embed.register_forward_hook(cut_rope)


def _glm(tr: torch.nn.Module, state: ShardState) -> None:
    tr.glyph_projector.register_forward_hook(_cut_output(state, "text", 1))
    tr.image_projector.register_forward_hook(_cut_output(state, "image", 1))
    tr.prior_projector.register_forward_hook(_cut_output(state, "image", 1))

    def cut_rope(module, args, output):
        return tuple(state.cut(t, "image", 0) for t in output)

    tr.rope.register_forward_hook(cut_rope)


# Transformer class name -> where its streams are cut. Every plan gathers proj_out's output
# (image tokens only: each family drops the text stream before it).
SHARD_PLANS: dict[str, Callable[[torch.nn.Module, ShardState], None]] = {
    "FluxTransformer2DModel": _flux,
    "QwenImageTransformer2DModel": _qwen,
    "GlmImageTransformer2DModel": _glm,
}


def _attention_modules(tr: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in tr.modules() if hasattr(m, "processor") and hasattr(m, "heads")]


def enable_ulysses(tr: torch.nn.Module, degree: int, index: int, group: Any) -> ShardState:
    """Install the cut/gather hooks and the attention all-to-all on `tr` (in place)."""
    name = type(tr).__name__
    plan = SHARD_PLANS.get(name)
    if plan is None:
        raise ValueError(f"ulysses_degree > 1: no sequence plan for {name} ({sorted(SHARD_PLANS)})")
    heads = int(tr.config.num_attention_heads)
    if heads % degree:
        raise ValueError(
            f"ulysses_degree={degree} does not divide {name}'s {heads} attention heads"
        )
    for attn in _attention_modules(tr):
        backend = getattr(attn.processor, "_attention_backend", None)
        if backend not in (None, "native"):
            raise ValueError(
                f"ulysses_degree > 1 needs diffusers' native attention (torch SDPA), "
                f"not {backend!r}"
            )
    state = ShardState(degree, index, group)
    tr.register_forward_pre_hook(_reset(state), with_kwargs=True)
    plan(tr, state)
    tr.proj_out.register_forward_hook(_gather_output(state, "image", 1))
    mode = _UlyssesAttention(state)
    for attn in _attention_modules(tr):
        attn.forward = _within(mode, attn.forward)
    return state


def _within(mode: TorchFunctionMode, forward: Callable) -> Callable:
    """The attention module's own forward with the all-to-all SDPA active (only there: the
    mode costs a Python call per torch op it sees)."""

    def run(*args, **kwargs):
        with mode:
            return forward(*args, **kwargs)

    return run
