"""Shared steps of the full-size random-weight builders (Qwen-Image, FLUX): build each module
where it will run in bf16, count it, save it through its own library, report as it goes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_omni_plugin.testing.full_glm_image import _construct, _count, default_device

# The hub's shard size for diffusers and transformers checkpoints.
MAX_SHARD = "5GB"


class ComponentWriter:
    """Builds one component at a time on `device`, saves it, frees it; keeps the counts."""

    def __init__(self, out_dir: Path, seed: int, device, report: Callable[[str], None]):
        self.out_dir = Path(out_dir)
        self.seed = seed
        self.device = torch.device(device) if device is not None else default_device()
        self.report = report
        self.counts: dict[str, int] = {}
        self.started = time.perf_counter()

    def write(self, name: str, factory: Callable[[], torch.nn.Module], offset: int) -> None:
        """Construct `factory()` seeded with seed + offset, save it to out_dir/name."""
        t0 = time.perf_counter()
        module = _construct(factory, self.device, self.seed + offset)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        self.counts[name] = _count(module)
        module.save_pretrained(self.out_dir / name, max_shard_size=MAX_SHARD)
        self.report(
            f"{name}: {self.counts[name] / 1e9:.3f}B params, init {t1 - t0:.1f}s on "
            f"{self.device}, write {time.perf_counter() - t1:.1f}s"
        )
        del module
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def summary(self, label: str, num_layers: int | None) -> str:
        depth = "" if num_layers is None else f" ({num_layers} layers per stack)"
        total = sum(self.counts.values())
        return (
            f"{label} full size{depth}: {total / 1e9:.2f}B params in bf16 written to "
            f"{self.out_dir} in {time.perf_counter() - self.started:.1f}s"
        )


def depth(value: int, num_layers: int | None) -> int:
    """A stack's depth: the published `value`, or `num_layers` when set (>= 1)."""
    if num_layers is None:
        return value
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return num_layers


def write_model_index(out_dir: Path, index: dict) -> None:
    """The pipeline's model_index.json (sorted keys, as the hub files are written here)."""
    (Path(out_dir) / "model_index.json").write_text(
        json.dumps(index, indent=2, sort_keys=True) + "\n"
    )
