"""The step cache of one diffusion engine: per-request policies applied inside step batching.

Adapters call `run(model, rows, kwargs)` instead of `model(**kwargs)`. `rows` lists the forward's
row groups in batch order: (request state, tag, rows), tag "cond" or "uncond". Per forward:

* taylorseer rows whose step is a forecast step leave the batch; their output is the Taylor
  forecast of the transformer output (diffusers' TaylorSeer "lite" mode) from their own factors;
* the rest run the model, whose wrapped blocks (blocks.py) let first_block and teacache rows skip
  with their own cached residuals;
* each request decides once per step, on its "cond" rows, and all its rows follow (CFG rows of one
  request decide together, also where the family runs them in separate forwards).

With no row of an active policy the model is called exactly as without a step cache. Where the
engine captures CUDA graphs, forwards whose blocks take no per-row path (uncached rows, TaylorSeer
rows that compute) replay the graph of the whole forward; forwards with first_block or teacache
rows run uncaptured, since their rows' paths are chosen on the host between blocks. (Graphs of
single blocks for those measured slower than the uncaptured forward with compiled blocks:
BENCHMARKS.md, "Step caching with CUDA graphs kept".)
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Hashable
from typing import Any

import torch

from ...common.cache_policy import (
    FIRST_BLOCK,
    NONE,
    TAYLORSEER,
    TEACACHE,
    CacheBounds,
    CachePolicy,
    CachePolicyError,
    parse_cache,
)
from ..cuda_graphs import uncaptured
from ..errors import DiffusionEngineError
from . import blocks
from .rows import RowGroup, regroup, row_index, take_rows
from .state import RequestCache

# Forward kwargs that are per token, not per row (FLUX's position ids).
SHARED_KWARGS = frozenset({"txt_ids", "img_ids", "attention_kwargs", "joint_attention_kwargs"})


class StepCache:
    def __init__(self, models: list[torch.nn.Module]) -> None:
        self.plan: blocks.ForwardPlan | None = None
        for m in models:
            blocks.install(m, self)
        self._lock = threading.Lock()
        self._skipped: Counter[str] = Counter()

    # ---- per request -------------------------------------------------------------------
    @staticmethod
    def attach(state: Any, policy: CachePolicy) -> None:
        """Give a request its cache state (none where its policy computes every step)."""
        state.step_cache = RequestCache(policy) if policy.active else None

    def skipped(self) -> dict[str, int]:
        """Steps whose transformer call was skipped, per policy, since the engine started."""
        with self._lock:
            return dict(self._skipped)

    # ---- per forward -------------------------------------------------------------------
    def run(
        self,
        model: Any,
        rows: list[tuple[Any, Hashable, int]],
        kwargs: dict[str, Any],
        expert: Hashable = 0,
    ) -> tuple[torch.Tensor, ...]:
        caches = [getattr(s, "step_cache", None) for s, _, _ in rows]
        if not any(caches):
            return model(**kwargs)
        groups, lo = [], 0
        for (state, tag, n), cache in zip(rows, caches, strict=True):
            if cache is not None:
                cache.begin(state.step, state.total_steps, expert)
            groups.append(RowGroup(cache, tag, lo, n))
            lo += n
        total = lo
        forecast = [g for g in groups if g.policy == TAYLORSEER and not _taylor_computes(g)]
        run = [g for g in groups if g not in forecast]
        out = None
        if run:
            kw = kwargs
            sub = regroup(run)
            if forecast:
                idx = row_index(run, _device(kwargs))
                keep = idx.tolist()
                kw = {
                    k: v if k in SHARED_KWARGS else take_rows(v, idx, total, keep)
                    for k, v in kwargs.items()
                }
            active = any(g.policy in (FIRST_BLOCK, TEACACHE) for g in sub)
            self.plan = blocks.ForwardPlan(sub, sum(g.n for g in sub), active)
            try:
                # A graph of the whole forward would replay one path for every row.
                result = (uncaptured(model) if active else model)(**kw)
            finally:
                self.plan = None
            out = result[0]
            for g in sub:
                if g.policy == TAYLORSEER:
                    _taylor_update(g, out[g.lo : g.hi])
        self._count(groups)
        if not forecast:
            return (out,)
        first = out if out is not None else _taylor_predict(forecast[0])
        full = first.new_empty((total, *first.shape[1:]))
        for g, s in zip(run, regroup(run), strict=True):
            full[g.lo : g.hi] = out[s.lo : s.hi]
        for g in forecast:
            full[g.lo : g.hi] = _taylor_predict(g)
        return (full,)

    def _count(self, groups: list[RowGroup]) -> None:
        seen: set[int] = set()
        with self._lock:
            for g in groups:
                c = g.cache
                if c is None or id(c) in seen:
                    continue
                seen.add(id(c))
                if c.compute is False and not c.pending.get("counted"):
                    self._skipped[c.policy.policy] += 1
                    c.pending["counted"] = True


def _device(kwargs: dict[str, Any]) -> torch.device:
    return kwargs["hidden_states"].device


def _taylor_computes(g: RowGroup) -> bool:
    """TaylorSeer's schedule (diffusers TaylorSeerCacheHook): compute the warm-up steps, then
    one step in every `interval`, forecast the others; the cond rows decide for the request."""
    c, p = g.cache, g.cache.policy
    if c.compute is None:
        s = c.local_step
        c.decide(s < p.warmup or (s - p.warmup - 1) % p.interval == 0)
    return bool(c.compute) or not c.slot(g.tag).factors


def _taylor_update(g: RowGroup, features: torch.Tensor) -> None:
    """New Taylor factors from this computed output (finite differences over steps)."""
    c, slot = g.cache, g.cache.slot(g.tag)
    new = [features]
    if slot.updated_at is not None:
        delta = c.local_step - slot.updated_at
        for j in range(c.policy.order):
            if j >= len(slot.factors) or slot.factors[j].shape != new[j].shape:
                break
            new.append((new[j] - slot.factors[j].to(features.dtype)) / delta)
    slot.factors = [f.to(torch.float32) for f in new]
    slot.dtype = features.dtype
    slot.updated_at = c.local_step


def _taylor_predict(g: RowGroup) -> torch.Tensor:
    c, slot = g.cache, g.cache.slot(g.tag)
    offset = c.local_step - slot.updated_at
    dtype = slot.dtype
    out = torch.zeros_like(slot.factors[0], dtype=dtype)
    for order, factor in enumerate(slot.factors):
        out = out + factor.to(dtype) * (offset**order / math.factorial(order))
    return out


def cache_bounds(config: Any) -> CacheBounds:
    """The stage's step-cache settings (config.step_cache) as CacheBounds; bad ones raise."""
    raw = dict(config.step_cache or {})
    try:
        policies = tuple(raw.pop("policies", None) or (NONE,))
        for p in policies:
            parse_cache({"policy": p}, "step_cache.policies")
        if NONE not in policies:
            policies = (NONE, *policies)
        max_threshold = float(raw.pop("max_threshold", CacheBounds.max_threshold))
        bounds = CacheBounds(policies, max_threshold)
        default = raw.pop("default", None)
        if default is not None:
            bounds = CacheBounds(
                policies, max_threshold, bounds.check(parse_cache(default, "step_cache.default"))
            )
    except CachePolicyError as exc:
        raise DiffusionEngineError(str(exc)) from None
    if raw:
        raise DiffusionEngineError(f"step_cache: unknown settings {sorted(raw)}")
    return bounds
