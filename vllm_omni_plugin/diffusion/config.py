"""Engine configuration: what a diffusion stage gets from its typed stage config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DiffusionEngineConfig:
    # Pipeline folder in the diffusers layout (model_index.json + component subfolders).
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    # Most images (latent rows before CFG doubling) denoised in one transformer forward.
    max_batch_size: int = 8
    max_num_inference_steps: int = 200
    # Total memory the stage may use (weights + activations), in GiB; None = no budget check.
    memory_budget_gb: float | None = None
    # Request defaults from the stage config (num_inference_steps, guidance_scale, height, width,
    # seed, negative_prompt, and family extras such as FLUX's true_cfg_scale).
    defaults: dict[str, Any] | None = None
    # Force an adapter by diffusers pipeline class name instead of model_index.json's _class_name.
    pipeline_class: str | None = None
    # Size bounds enforced at validation (None = the family's own bounds).
    min_height: int | None = None
    min_width: int | None = None
    max_height: int | None = None
    max_width: int | None = None
    # Height/width must also be multiples of this (on top of the family's own granularity).
    size_granularity: int | None = None
    # torch.compile the denoising transformer (GPU serving; first steps pay the compile).
    compile_transformer: bool = False
    # Compile each repeated block instead of the whole forward: one graph per block type,
    # so seconds of compile instead of minutes, the same kernels inside the blocks.
    compile_regional: bool = False
    # torch.compile mode (None = default; e.g. "max-autotune-no-cudagraphs") and fullgraph.
    compile_mode: str | None = None
    compile_fullgraph: bool = False
    # Benchmark knobs, not in the stage config: neither paid off on the H200 (BENCHMARKS.md).
    # One Q|K|V GEMM instead of three (FLUX); CUDA only, lossless.
    fuse_qkv: bool = False
    # SDPA kernel torch tries first: "cudnn" | "flash" | "efficient" | "math"; None = torch's
    # order (torch 2.11 already picks cuDNN attention on Hopper). CUDA only.
    attention_backend: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_stage_config(cls, stage: Any) -> DiffusionEngineConfig:
        """Build from team B's typed StageConfig of a diffusion stage (duck-typed, no import)."""
        owner = stage.diffusion
        defaults: dict[str, Any] = {}
        sampling = getattr(stage, "sampling", None)
        if sampling is not None and hasattr(sampling, "defaults_dict"):
            defaults = sampling.defaults_dict()
        return cls(
            model=str(stage.model_path),
            device=owner.device or "cuda",
            dtype=owner.dtype,
            max_batch_size=owner.max_batch_size,
            max_num_inference_steps=owner.max_num_inference_steps,
            memory_budget_gb=owner.memory_budget_gb,
            defaults=defaults,
            pipeline_class=owner.pipeline_class,
            min_height=owner.min_height,
            min_width=owner.min_width,
            max_height=owner.max_height,
            max_width=owner.max_width,
            size_granularity=owner.size_granularity,
            compile_transformer=owner.compile_transformer,
            compile_regional=owner.compile_regional,
        )
