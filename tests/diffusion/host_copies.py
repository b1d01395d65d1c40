"""A guard that records host<->device data movement in torch calls, and the transformer
inputs of a real batched engine step (tests/diffusion/test_*sync_free.py, test_step_host_copies.py).

A CPU has no device to copy to, so the steps run on PyTorch's meta device (shapes without
data): a copy from host memory onto it is still a call that puts host data on a non-CPU device,
and a read back of a meta tensor is still a call that reads one.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

FROM_HOST = {"tensor", "as_tensor", "asarray", "from_numpy"}  # host data -> a new tensor
MOVES = {"to", "cuda", "copy_", "_to_copy"}  # a tensor's data to another device
READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _device(value) -> str | None:
    return value.device.type if isinstance(value, torch.Tensor) else None


class HostDeviceCopies(TorchFunctionMode):
    """Records each torch call that moves data between the host and a non-CPU device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        source = _device(
            args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None
        )
        if name in READS and source not in (None, "cpu"):
            self.seen.append(name)
        out = func(*args, **(kwargs or {}))
        target = _device(args[0] if name == "copy_" else out)
        if name in FROM_HOST and target not in (None, "cpu"):
            self.seen.append(name)
        if name in MOVES and source and target and (source == "cpu") != (target == "cpu"):
            self.seen.append(name)
        return out


def record_steps(engine, requests) -> list[tuple[object, dict]]:
    """(the called transformer, its keyword arguments) of every forward the adapter runs for
    `requests` (generated together, so the engine batches them), as the adapter builds them."""
    adapter, seen = engine.adapter, []
    run = adapter.run_transformer

    def record(model, rows, kwargs, *rest):
        copy = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, kwargs)
        seen.append((model, copy))
        return run(model, rows, kwargs, *rest)

    adapter.run_transformer = record
    try:
        outputs = engine.generate(requests)
    finally:
        del adapter.run_transformer
    assert [o.error for o in outputs] == [None] * len(requests)
    return seen


def on_meta(transformer: torch.nn.Module) -> torch.nn.Module:
    """A transformer of the same class and config on the meta device."""
    with torch.device("meta"):
        return type(transformer).from_config(transformer.config)


def to_meta(kwargs: dict) -> dict:
    meta = torch.device("meta")
    return tree_map(lambda t: t.to(meta) if isinstance(t, torch.Tensor) else t, kwargs)


def copies_in_warm_call(step, kwargs: dict) -> tuple[list[str], object]:
    """What the guard sees in `step(**kwargs)` (meta tensors) after one unwatched warm call
    (as StepGraphs makes before capturing: lazy caches fill once), and the call's output."""
    with torch.no_grad():
        step(**kwargs)
        with HostDeviceCopies() as guard:
            out = step(**kwargs)
    return guard.seen, out
