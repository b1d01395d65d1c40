"""The transformer's blocks, wrapped so each row of a forward can take its own path.

The first block is the head, the others the tail. Per forward (a `ForwardPlan`, set by
`StepCache.call`), each request's rows:

* compute: head and tail, as without caching;
* skip after the head (first_block): the head runs; when its residual barely changed since the
  last computed step, the output is the head's output plus the cached residual of the tail;
* skip the whole stack (teacache): when the accumulated change of the modulated input stays under
  the threshold, the output is the input plus the cached residual of all blocks.

Rows that compute run the tail as one smaller batch; the last block puts every row back in its
place. Without a plan (no row with an active policy) the wrappers call the block unchanged.
The block output layout ((encoder, hidden) or (hidden, encoder) or hidden) per block class is the
one diffusers' own cache hooks use.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.cache_policy import FIRST_BLOCK, TEACACHE
from . import teacache
from .rows import RowGroup, row_index, take_rows

# block class -> (index of hidden_states in its output, index of encoder_hidden_states or None)
OUTPUTS: dict[str, tuple[int, int | None]] = {
    "FluxTransformerBlock": (1, 0),
    "FluxSingleTransformerBlock": (1, 0),
    "QwenImageTransformerBlock": (1, 0),
    "GlmImageTransformerBlock": (0, 1),
    "WanTransformerBlock": (0, None),
}
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks")


@dataclass
class ForwardPlan:
    groups: list[RowGroup]
    rows: int
    blocks_active: bool  # any row whose policy acts inside the blocks (first_block, teacache)
    # Filled by the head block:
    compute: list[RowGroup] = field(default_factory=list)  # rows that run the tail
    index: torch.Tensor | None = None  # their row numbers
    skip_head: list[RowGroup] = field(default_factory=list)  # first_block skips
    skip_stack: list[RowGroup] = field(default_factory=list)  # teacache skips
    inputs: tuple[torch.Tensor | None, ...] = ()  # (hidden, encoder) into the head, all rows
    head: tuple[torch.Tensor | None, ...] = ()  # (hidden, encoder) out of the head, all rows


class CachedBlock(torch.nn.Module):
    """One block of the stack; `role` is "head", "tail" or "last"."""

    def __init__(self, inner: torch.nn.Module, role: str, owner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.role = role
        name = type(inner).__name__
        self.hidden_at, self.encoder_at = OUTPUTS[name]
        self._params = list(inspect.signature(inner.forward).parameters)
        object.__setattr__(self, "_owner", owner)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        plan: ForwardPlan | None = self._owner.plan
        if plan is None or not plan.blocks_active:
            return self.inner(*args, **kwargs)
        bound = dict(zip(self._params, args, strict=False))
        bound.update(kwargs)
        if self.role == "head":
            return self._head(plan, bound)
        if not plan.compute:
            out = self._passthrough(bound)
        else:
            out = self.inner(**self._rows(plan, bound))
        return self._assemble(plan, out) if self.role == "last" else out

    # ---- head --------------------------------------------------------------------------
    def _head(self, plan: ForwardPlan, args: dict[str, Any]) -> Any:
        hidden = args["hidden_states"]
        encoder = args.get("encoder_hidden_states") if self.encoder_at is not None else None
        plan.inputs = (hidden, encoder)
        self._decide_teacache(plan, args)
        run = [g for g in plan.groups if g not in plan.skip_stack]
        if run:
            sub = args if len(run) == len(plan.groups) else self._subset(plan, args, run)
            out = self.inner(**sub)
        else:
            out = None
        plan.head = self._scatter(plan, run, out)
        self._decide_first_block(plan, run)
        plan.compute = [g for g in run if g not in plan.skip_head]
        if plan.compute and len(plan.compute) < len(plan.groups):
            plan.index = row_index(plan.compute, hidden.device)
        if not plan.compute:
            return self._pack(plan.head[0], plan.head[1])
        if len(plan.compute) == len(plan.groups):
            return out
        h, e = plan.head
        idx = plan.index
        return self._pack(h.index_select(0, idx), None if e is None else e.index_select(0, idx))

    def _subset(self, plan: ForwardPlan, args: dict[str, Any], run: list[RowGroup]):
        idx = row_index(run, args["hidden_states"].device)
        keep = idx.tolist()
        return {k: self._take(k, v, idx, plan.rows, keep) for k, v in args.items()}

    @staticmethod
    def _take(name: str, value: Any, idx: torch.Tensor, rows: int, keep: list[int]) -> Any:
        if "rotary" in name:  # per token, shared by the rows
            return value
        return take_rows(value, idx, rows, keep)

    def _scatter(self, plan: ForwardPlan, run: list[RowGroup], out: Any):
        """The head's (hidden, encoder) output for all rows (inputs where it did not run)."""
        hidden, encoder = plan.inputs
        if out is None:
            return hidden, encoder
        h, e = self._split(out)
        if len(run) == len(plan.groups):
            return h, e
        idx = row_index(run, hidden.device)
        full_h = hidden.to(h.dtype).index_copy(0, idx, h)
        full_e = None if e is None else encoder.to(e.dtype).index_copy(0, idx, e)
        return full_h, full_e

    def _decide_teacache(self, plan: ForwardPlan, args: dict[str, Any]) -> None:
        deciding = [
            g for g in plan.groups if g.policy == TEACACHE and g.cache.compute is None and g.primary
        ]
        if deciding:
            mod = teacache.modulated_input(self.inner, args)
            metrics = []
            for g in deciding:
                cur = mod[g.lo : g.hi]
                prev = g.cache.slot(g.tag).modulated
                g.cache.slot(g.tag).modulated = cur
                if prev is None or prev.shape != cur.shape:
                    metrics.append(None)
                else:
                    metrics.append((cur - prev).abs().mean() / prev.abs().mean())
            values = _host([m for m in metrics if m is not None])
            name = type(self.inner).__name__
            for g, m in zip(deciding, metrics, strict=True):
                c, slot = g.cache, g.cache.slot(g.tag)
                first = c.local_step == 0 or c.step == c.total_steps - 1 or m is None
                if first or slot.stack_residual is None:
                    slot.accumulated = 0.0
                    c.decide(True)
                    continue
                slot.accumulated += teacache.rescale(name, values.pop(0))
                if slot.accumulated < c.policy.threshold:
                    c.decide(False)
                else:
                    slot.accumulated = 0.0
                    c.decide(True)
        for g in plan.groups:
            if g.policy != TEACACHE:
                continue
            if g.cache.compute is None:  # its deciding rows are not in this forward
                g.cache.decide(True)
            if not g.cache.compute and g.cache.slot(g.tag).stack_residual is not None:
                plan.skip_stack.append(g)

    def _decide_first_block(self, plan: ForwardPlan, run: list[RowGroup]) -> None:
        hidden_in, _ = plan.inputs
        fb = [g for g in run if g.policy == FIRST_BLOCK]
        if not fb:
            return
        deciding = [g for g in fb if g.cache.compute is None and g.primary]
        residuals, metrics = {}, []
        for g in deciding:
            res = plan.head[0][g.lo : g.hi] - hidden_in[g.lo : g.hi]
            residuals[id(g)] = res
            prev = g.cache.slot(g.tag).head_residual
            if prev is not None and prev.shape == res.shape:
                metrics.append((res - prev).abs().mean() / prev.abs().mean())
        values = _host(metrics)
        for g in deciding:
            slot = g.cache.slot(g.tag)
            prev = slot.head_residual
            compute = prev is None or prev.shape != residuals[id(g)].shape
            if not compute:
                compute = values.pop(0) > g.cache.policy.threshold
            if compute:
                slot.head_residual = residuals[id(g)]
            g.cache.decide(compute)
        for g in fb:
            if g.cache.compute is None:
                g.cache.decide(True)
            if not g.cache.compute and g.cache.slot(g.tag).tail_residual is not None:
                plan.skip_head.append(g)

    # ---- tail --------------------------------------------------------------------------
    def _rows(self, plan: ForwardPlan, args: dict[str, Any]) -> dict[str, Any]:
        if plan.index is None:
            return args
        keep = plan.index.tolist() if _has_lists(args, plan.rows) else []
        return {k: self._take(k, v, plan.index, plan.rows, keep) for k, v in args.items()}

    def _passthrough(self, args: dict[str, Any]) -> Any:
        hidden = args["hidden_states"]
        encoder = args.get("encoder_hidden_states") if self.encoder_at is not None else None
        return self._pack(hidden, encoder)

    def _assemble(self, plan: ForwardPlan, out: Any) -> Any:
        """Every row back in its place; residuals of the rows that computed kept."""
        hidden_in, encoder_in = plan.inputs
        head_h, head_e = plan.head
        if plan.compute:
            h, e = self._split(out)
            if plan.index is not None:
                h = head_h.to(h.dtype).index_copy(0, plan.index, h)
                e = None if e is None else head_e.to(e.dtype).index_copy(0, plan.index, e)
        else:
            h, e = head_h.clone(), None if head_e is None else head_e.clone()
        for g in plan.compute:
            if g.policy == FIRST_BLOCK:
                g.cache.slot(g.tag).tail_residual = _residual(h, e, head_h, head_e, g)
            elif g.policy == TEACACHE:
                g.cache.slot(g.tag).stack_residual = _residual(h, e, hidden_in, encoder_in, g)
        for g in plan.skip_head:
            _add_into(h, e, head_h, head_e, g.cache.slot(g.tag).tail_residual, g)
        for g in plan.skip_stack:
            _add_into(h, e, hidden_in, encoder_in, g.cache.slot(g.tag).stack_residual, g)
        return self._pack(h, e)

    # ---- output layout -----------------------------------------------------------------
    def _split(self, out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.encoder_at is None:
            return (out[self.hidden_at] if isinstance(out, tuple) else out), None
        return out[self.hidden_at], out[self.encoder_at]

    def _pack(self, hidden: torch.Tensor, encoder: torch.Tensor | None) -> Any:
        if self.encoder_at is None:
            return hidden
        out: list[Any] = [None, None]
        out[self.hidden_at], out[self.encoder_at] = hidden, encoder
        return tuple(out)


def _host(values: list[torch.Tensor]) -> list[float]:
    """All decision metrics of a forward in one device-to-host copy."""
    if not values:
        return []
    return torch.stack([v.float() for v in values]).tolist()


def _has_lists(args: dict[str, Any], rows: int) -> bool:
    return any(isinstance(v, list) and len(v) == rows for v in args.values())


def _residual(h, e, base_h, base_e, g: RowGroup):
    rh = h[g.lo : g.hi] - base_h[g.lo : g.hi]
    re_ = None if e is None or base_e is None else e[g.lo : g.hi] - base_e[g.lo : g.hi]
    return rh, re_


def _add_into(h, e, base_h, base_e, residual, g: RowGroup) -> None:
    # residual + base: the operand order diffusers' FirstBlockCache uses (bit-equal outputs).
    h[g.lo : g.hi] = residual[0] + base_h[g.lo : g.hi]
    if e is not None and residual[1] is not None:
        e[g.lo : g.hi] = residual[1] + base_e[g.lo : g.hi]


def install(model: torch.nn.Module, owner: Any) -> int:
    """Wrap the model's blocks (head, tail..., last); returns how many. Idempotent."""
    if getattr(getattr(model, "config", None), "zero_cond_t", False):
        # Qwen-Image-Edit-2511's doubled timestep rows (one per row and per condition image)
        # do not follow the batch rows this cache takes apart.
        raise TypeError(f"{type(model).__name__} with zero_cond_t is not supported")
    blocks: list[tuple[torch.nn.ModuleList, int]] = []
    for name, child in model.named_children():
        if name in BLOCK_LISTS and isinstance(child, torch.nn.ModuleList):
            blocks.extend((child, i) for i in range(len(child)))
    if any(isinstance(lst[i], CachedBlock) for lst, i in blocks):
        return len(blocks)
    if len(blocks) < 2:
        raise TypeError(f"{type(model).__name__}: step caching needs at least two blocks")
    for k, (lst, i) in enumerate(blocks):
        if type(lst[i]).__name__ not in OUTPUTS:
            raise TypeError(f"step caching does not know block {type(lst[i]).__name__}")
        role = "head" if k == 0 else "last" if k == len(blocks) - 1 else "tail"
        lst[i] = CachedBlock(lst[i], role, owner)
    return len(blocks)
