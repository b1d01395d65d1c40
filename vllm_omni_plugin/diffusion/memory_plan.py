"""The diffusion engine's memory plan: the bytes a stage's settings give it, less the weights,
and what each request needs of them (common/memory.py's MemoryModel, which the stage also
announces so the API server refuses with the same arithmetic).

A request whose estimate exceeds the activation budget on its own is refused when it arrives
(CapacityError, a 4xx naming the setting), never admitted to fail with an out-of-memory error
in a batch; requests that fit alone share forwards only while their sum fits (the scheduler's
cost).
"""

from __future__ import annotations

import os

import torch

from ..common.memory import MemoryModel
from .adapters.base import DiffusionAdapter
from .config import DiffusionEngineConfig
from .errors import CapacityError, DiffusionEngineError
from .request import GenerationRequest


def total_budget(config: DiffusionEngineConfig, device: torch.device) -> int | None:
    """Bytes the stage may use: memory_budget_gb, or gpu_memory_utilization of the device.

    On CUDA the fraction is also set as the caching allocator's cap, so the process cannot
    exceed it even where the activation estimate is off; on CPU it is a fraction of host RAM
    and acts through the budget check only.
    """
    frac = config.gpu_memory_utilization
    if frac is not None and config.memory_budget_gb is not None:
        raise DiffusionEngineError("set memory_budget_gb or gpu_memory_utilization, not both")
    if config.memory_budget_gb is not None:
        return int(config.memory_budget_gb * 2**30)
    if frac is None:
        return None
    if not 0 < frac <= 1:
        raise DiffusionEngineError(f"gpu_memory_utilization must be in (0, 1], got {frac}")
    if device.type == "cuda":
        # torch wants an index here: a bare "cuda" device raises (seen on the H200).
        index = device.index if device.index is not None else 0
        torch.cuda.set_per_process_memory_fraction(frac, index)
        total = torch.cuda.get_device_properties(index).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(frac * total)


def _limit_name(config: DiffusionEngineConfig, budget: int, device: torch.device) -> str:
    if config.memory_budget_gb is not None:
        return f"memory_budget_gb={config.memory_budget_gb:g}"
    return (
        f"gpu_memory_utilization={config.gpu_memory_utilization:g} "
        f"({budget / 2**30:.3f} GiB of {device.type} memory)"
    )


def plan_memory(
    config: DiffusionEngineConfig,
    adapter: DiffusionAdapter,
    budget: int | None,
    device: torch.device,
    dtype: torch.dtype,
) -> MemoryModel | None:
    """The stage's MemoryModel (None: no budget set); a budget below the weights is an error."""
    if budget is None:
        return None
    weights = adapter.weight_bytes()
    limit = _limit_name(config, budget, device)
    left = budget - weights
    if left <= 0:
        raise DiffusionEngineError(
            f"{limit} is smaller than the model weights ({weights / 2**30:.3f} GiB)"
        )
    elem = torch.tensor([], dtype=dtype).element_size()
    # CUDA's fused SDPA kernels never hold the score matrix; CPU and math SDPA do.
    scores = device.type != "cuda" or config.attention_backend == "math"
    return MemoryModel(
        budget_bytes=left,
        limit=limit,
        element_bytes=elem,
        attention_scores=scores,
        **adapter.memory_facts(),
    )


def request_shape(adapter: DiffusionAdapter, req: GenerationRequest, cfg: bool) -> dict:
    """The MemoryModel arguments of a validated request."""
    return {
        "height": req.height,
        "width": req.width,
        "frames": adapter.output_frames(req),
        "n": req.n,
        "cfg": cfg,
        "sources": len(req.input_images),
    }


def check_fits(memory: MemoryModel | None, adapter: DiffusionAdapter, req, cfg: bool) -> None:
    """CapacityError (naming the field and the setting) when `req` alone cannot fit."""
    if memory is None:
        return
    refused = memory.refusal(**request_shape(adapter, req, cfg))
    if refused is not None:
        raise CapacityError(*refused)
