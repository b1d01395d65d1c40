"""CUDA graphs over the denoising transformer's forward, one per input signature.

A denoising step at a fixed batch size, resolution and text length launches the same kernels
with the same sizes every time: after a shape's first call (eager or compiling), its second call
captures the forward into a CUDA graph and every later call replays it (one launch instead of
hundreds, no launch gaps, no Python on the path). Lossless: the graph runs the very kernels the
uncaptured call runs.

The signature is every tensor argument's shape, dtype and device plus every other argument's
value, so a batch size, resolution or text length gets its own graph, and a call the graph cannot
reproduce (a CPU tensor among the inputs, an unhashable argument) runs uncaptured.

Memory is bounded two ways:
  * all graphs share ONE memory pool: a capture reuses the blocks earlier captures freed, so the
    pool holds about the largest forward's activations, not their sum (graphs never run
    concurrently, and outputs are cloned out right after each replay, so one graph overwriting
    another's freed blocks is harmless);
  * at most `max_graphs` graphs are kept (least recently used evicted); besides the shared pool,
    each holds only copies of its inputs (latents, text embeddings: a few MB).
A capture that fails (an op that syncs with the host, out of memory) leaves that signature
uncaptured for good, with a warning; the forward then runs as before.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Signatures counted before capture (bounded: only recurring shapes are worth a graph).
_MAX_SEEN = 1024


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one, a device without an index being the current one.

    Plain equality is not enough: the engine's device is `cuda` while its tensors report `cuda:0`,
    and `torch.device("cuda") != torch.device("cuda", 0)`; an equality check here once left every
    forward uncaptured on the H200."""
    if a.type != b.type:
        return False
    if a.index == b.index or a.type == "cpu":
        return True
    if a.type != "cuda":
        return False
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def signature(value: Any, device: torch.device) -> Hashable | None:
    """A hashable key for the call's arguments, or None when they cannot be replayed."""
    if isinstance(value, torch.Tensor):
        if not same_device(value.device, device) or value.requires_grad:
            return None
        return ("T", tuple(value.shape), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, (tuple, list)):
        items = [signature(v, device) for v in value]
        return None if any(i is None for i in items) else (type(value).__name__, *items)
    if isinstance(value, dict):
        items = [(k, signature(v, device)) for k, v in sorted(value.items())]
        return None if any(i is None for _, i in items) else ("dict", *items)
    return None


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):  # sorted: the same order whatever order the caller used
        return {k: _map_tensors(value[k], fn) for k in sorted(value)}
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _map_tensors(value, out.append)
    return out


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _Graph:
    """One captured forward: static input buffers, the graph, its static outputs."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], pool: Any, device) -> None:
        self.inputs = _map_tensors(kwargs, lambda t: t.clone())
        self._flat_inputs = _tensors(self.inputs)
        # One call on a side stream first, as torch prescribes before a capture: lazy
        # initialisations (cuBLAS handles, kernel loading, a compile of this shape) happen
        # outside the graph.
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn(**self.inputs)
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the stage process (I/O, stats) may touch CUDA meanwhile.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.outputs = fn(**self.inputs)

    def replay(self, kwargs: dict[str, Any]) -> Any:
        for static, new in zip(self._flat_inputs, _tensors(kwargs), strict=True):
            if static.data_ptr() != new.data_ptr():
                static.copy_(new)
        self.graph.replay()
        # The next replay (of this graph or one sharing the pool) overwrites the outputs.
        return _map_tensors(self.outputs, lambda t: t.clone())


class StepGraphs:
    """Calls `fn` with keyword arguments, through a CUDA graph per recurring signature."""

    def __init__(
        self, fn: Callable[..., Any], device: torch.device, max_graphs: int = 8, capture_at: int = 2
    ) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.fn, self.device, self.max_graphs, self.capture_at = fn, device, max_graphs, capture_at
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: dict[Hashable, int] = {}
        self._failed: set[Hashable] = set()
        self._pool: Any = None
        self.stats = {"captures": 0, "replays": 0, "evictions": 0, "failures": 0, "uncaptured": 0}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = None if args else signature(kwargs, self.device)
        if key is None or key in self._failed:
            self.stats["uncaptured"] += 1
            return self.fn(*args, **kwargs)
        graph = self._graphs.get(key)
        if graph is None:
            seen = self._seen.get(key, 0) + 1
            if len(self._seen) >= _MAX_SEEN and key not in self._seen:
                self._seen.clear()
            self._seen[key] = seen
            if seen < self.capture_at:
                self.stats["uncaptured"] += 1
                return self.fn(**kwargs)
            graph = self._capture(key, kwargs)
            if graph is None:
                return self.fn(**kwargs)
        else:
            self._graphs.move_to_end(key)
        self.stats["replays"] += 1
        return graph.replay(kwargs)

    def _capture(self, key: Hashable, kwargs: dict[str, Any]) -> _Graph | None:
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
            self.stats["evictions"] += 1
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.device(_device_index(self.device)):
                graph = _Graph(self.fn, kwargs, self._pool, self.device)
        except Exception as exc:
            self._failed.add(key)
            self.stats["failures"] += 1
            logger.warning(
                "CUDA graph capture failed for %s; this shape runs uncaptured: %s: %s",
                key,
                type(exc).__name__,
                str(exc)[:300],
            )
            return None
        self._graphs[key] = graph
        self._seen.pop(key, None)
        self.stats["captures"] += 1
        return graph

    def clear(self) -> None:
        """Drop every graph (their pool memory goes back to the caching allocator)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = None

    def __getattr__(self, name: str) -> Any:  # config, dtype, ... of the wrapped module
        if name == "fn":  # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.fn, name)


def uncaptured(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What `fn` calls without its CUDA graphs (itself where it has none)."""
    return fn.fn if isinstance(fn, StepGraphs) else fn
