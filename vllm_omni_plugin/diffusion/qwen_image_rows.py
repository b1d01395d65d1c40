"""Qwen-Image family joint attention run per row when a batch's prompts differ in length.

A batch of prompts of different lengths reaches the transformer right-padded, with an
`encoder_hidden_states_mask`; diffusers' `QwenDoubleStreamAttnProcessor2_0` turns the mask into
an attention mask over the joint (text + image) keys. torch's flash kernel takes no mask, so a
masked SDPA runs another kernel over every row, and a batch of mixed prompts paid more per
image than each prompt alone.

`RowAttnProcessor` (set on the transformer's attention modules by `install`) keeps the batched
projections, norms and RoPE of diffusers' processor and replaces only the attention: each run of
consecutive rows with one text length attends over its own unpadded joint sequence (its text
tokens, then the image tokens) with no mask, so every call may take the fused kernel. That is
the math of each prompt alone: padded keys get no weight under the mask either, and a text
token's RoPE position does not depend on the padded length. The padded text positions' outputs
are zeros (under the mask they were some mixture of values); no valid token reads them: they
are keys of no later attention, and the transformer's output is the image stream's.

The rows' text lengths come from the adapter, as `attention_kwargs={"text_lengths": (...)}`
(one int per row), only when they differ: they travel the forward's own route to the processor,
and, being part of the call's arguments, they are part of a CUDA graph's signature (a graph
captured for some lengths is never replayed for others). Without them the call is diffusers'
own processor, unchanged (equal lengths, no mask). The per-row part runs outside torch.compile
(`torch.compiler.disable`): the lengths change with every batch, and compiled code would be
specialised to them; the projections around it stay compiled.

Where the rows or tokens a block sees are not the whole batch the lengths describe (the step
cache's row subsets, CFG-parallel's row split, Ulysses' token split) the lengths do not match
the call's shapes, and the attention takes diffusers' masked path (the same result, no speed-up).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)
from torch import nn

MODEL = "QwenImageTransformer2DModel"
TEXT_LENGTHS = "text_lengths"  # the attention_kwargs entry: each row's text tokens


class RowAttnProcessor:
    """diffusers' Qwen double-stream joint attention, unmasked per run of equal text lengths
    when the call carries `text_lengths`. Of the calls carrying them, `per_row_calls` counts
    those run per row and `masked_calls` those whose shapes the lengths did not fit (Python
    counts them: a CUDA graph replay counts nothing)."""

    def __init__(self, inner: QwenDoubleStreamAttnProcessor2_0) -> None:
        self.inner = inner
        self.per_row_calls = 0
        self.masked_calls = 0

    # diffusers' set_attention_backend / context parallelism write these on every processor:
    # the wrapped one keeps them, for its own path and for ours.
    @property
    def _attention_backend(self) -> Any:
        return self.inner._attention_backend

    @_attention_backend.setter
    def _attention_backend(self, value: Any) -> None:
        self.inner._attention_backend = value

    @property
    def _parallel_config(self) -> Any:
        return self.inner._parallel_config

    @_parallel_config.setter
    def _parallel_config(self, value: Any) -> None:
        self.inner._parallel_config = value

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        text_lengths: tuple[int, ...] | list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if text_lengths is None or encoder_hidden_states is None or attention_mask is not None:
            return self.inner(
                attn,
                hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                attention_mask=attention_mask,
                image_rotary_emb=image_rotary_emb,
            )
        head_dim = attn.inner_dim // attn.heads
        img_q, img_k, img_v = (
            proj(hidden_states).unflatten(-1, (-1, head_dim))
            for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        txt_q, txt_k, txt_v = (
            proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
            for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q = apply_rotary_emb_qwen(img_q, img_freqs, use_real=False)
            img_k = apply_rotary_emb_qwen(img_k, img_freqs, use_real=False)
            txt_q = apply_rotary_emb_qwen(txt_q, txt_freqs, use_real=False)
            txt_k = apply_rotary_emb_qwen(txt_k, txt_freqs, use_real=False)
        txt_out, img_out = joint_attention(
            self,
            (txt_q, txt_k, txt_v),
            (img_q, img_k, img_v),
            encoder_hidden_states_mask,
            tuple(text_lengths),
        )
        dtype = txt_q.dtype
        img_out = attn.to_out[0](img_out.flatten(2, 3).to(dtype).contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)  # dropout
        txt_out = attn.to_add_out(txt_out.flatten(2, 3).to(dtype).contiguous())
        return img_out, txt_out


def fits(text_lengths: tuple[int, ...], rows: int, padded: int) -> bool:
    """Whether the lengths describe this call's rows and its whole (padded) text."""
    return len(text_lengths) == rows and max(text_lengths) == padded and min(text_lengths) >= 0


def runs(text_lengths: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first row, end row, text length) of each run of consecutive rows of one length."""
    out: list[tuple[int, int, int]] = []
    for row, length in enumerate(text_lengths):
        if out and out[-1][2] == length:
            out[-1] = (out[-1][0], row + 1, length)
        else:
            out.append((row, row + 1, length))
    return out


@torch.compiler.disable
def joint_attention(
    processor: RowAttnProcessor,
    txt: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    img: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    text_mask: torch.Tensor | None,
    text_lengths: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(text, image) attention outputs, [rows, tokens, heads, head_dim] each: per run of rows
    over their unpadded joint sequences when the lengths fit the call, else diffusers' masked
    attention over the padded batch."""
    backend, parallel = processor._attention_backend, processor._parallel_config
    rows, padded = txt[0].shape[:2]
    if not fits(text_lengths, rows, padded):
        processor.masked_calls += 1
        return masked_attention(txt, img, text_mask, backend, parallel)
    processor.per_row_calls += 1
    txt_parts, img_parts = [], []
    for lo, hi, n in runs(text_lengths):
        q, k, v = (
            torch.cat([t[lo:hi, :n], i[lo:hi]], dim=1) for t, i in zip(txt, img, strict=True)
        )
        out = dispatch_attention_fn(
            q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
            backend=backend, parallel_config=parallel,
        )  # fmt: skip
        txt_parts.append(F.pad(out[:, :n], (0, 0, 0, 0, 0, padded - n)))
        img_parts.append(out[:, n:])
    return torch.cat(txt_parts), torch.cat(img_parts)


def masked_attention(
    txt: tuple[torch.Tensor, ...],
    img: tuple[torch.Tensor, ...],
    text_mask: torch.Tensor | None,
    backend: Any,
    parallel: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' joint attention over the padded batch, its key-padding mask from `text_mask`
    (the same ops in the same order as QwenDoubleStreamAttnProcessor2_0)."""
    mask = None
    if text_mask is not None:
        image_mask = torch.ones(img[0].shape[:2], dtype=torch.bool, device=img[0].device)
        mask = torch.cat([text_mask, image_mask], dim=1)[:, None, None, :]
    q, k, v = (torch.cat([t, i], dim=1) for t, i in zip(txt, img, strict=True))
    out = dispatch_attention_fn(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
        backend=backend, parallel_config=parallel,
    )  # fmt: skip
    padded = txt[0].shape[1]
    return out[:, :padded], out[:, padded:]


def processors(transformer: nn.Module) -> list[RowAttnProcessor]:
    """The transformer's installed per-row processors (empty when `install` did not run)."""
    return [p for p in transformer.attn_processors.values() if isinstance(p, RowAttnProcessor)]


def installed(transformer: nn.Module) -> bool:
    return type(transformer).__name__ == MODEL and bool(processors(transformer))


def install(transformer: nn.Module) -> Callable[[], None] | None:
    """Wrap every diffusers double-stream processor of a Qwen-Image transformer (in place);
    returns the undo, or None (another model, already installed, or none to wrap)."""
    if type(transformer).__name__ != MODEL or installed(transformer):
        return None
    originals = dict(transformer.attn_processors)
    wrapped = {
        name: RowAttnProcessor(p) if type(p) is QwenDoubleStreamAttnProcessor2_0 else p
        for name, p in originals.items()
    }
    if not any(isinstance(p, RowAttnProcessor) for p in wrapped.values()):
        return None
    transformer.set_attn_processor(wrapped)

    def undo() -> None:
        transformer.set_attn_processor(originals)

    return undo


def attention_kwargs(transformer: nn.Module, text_lengths: list[int]) -> dict[str, Any]:
    """The forward's `attention_kwargs` for rows of these text lengths: the lengths when they
    differ and the transformer runs the per-row processor, else none (diffusers' path)."""
    if len(set(text_lengths)) < 2 or not installed(transformer):
        return {}
    return {TEXT_LENGTHS: tuple(text_lengths)}


def counts(transformer: nn.Module) -> dict[str, int]:
    """Attention calls so far, summed over the blocks: {"per_row": ..., "masked": ...}."""
    procs = processors(transformer)
    return {
        "per_row": sum(p.per_row_calls for p in procs),
        "masked": sum(p.masked_calls for p in procs),
    }
