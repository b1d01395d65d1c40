"""Engine configuration: what a diffusion stage gets from its typed stage config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# DiffusionOwner fields the engine does not take: each is refused or warned about when the
# config loads (config/stage_build.py), so none of them is silently dropped here.
OWNER_FIELDS_NOT_IN_ENGINE = frozenset({"enable_cpu_offload", "cache_backend", "cache_config"})


@dataclass
class DiffusionEngineConfig:
    # Pipeline folder in the diffusers layout (model_index.json + component subfolders).
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    # Most images (latent rows before CFG doubling) denoised in one transformer forward.
    max_batch_size: int = 8
    # Most sequence tokens of one forward over all its rows (CFG rows count); a request above it
    # runs alone (None: no token bound).
    max_batch_tokens: int | None = None
    max_num_inference_steps: int = 200
    # Total memory the stage may use (weights + activations), in GiB; None = no budget check.
    memory_budget_gb: float | None = None
    # Fraction of the device's memory the stage may use (CUDA: also the allocator's hard cap via
    # torch.cuda.set_per_process_memory_fraction; CPU: a fraction of host RAM). Either this or
    # memory_budget_gb sets the budget that requests are checked against.
    gpu_memory_utilization: float | None = None
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
    # An idle engine holds a new request up to this long for others to fill the batch with
    # (None/0: start at once; step-batched families only).
    request_batch_max_wait_ms: float | None = None
    # Prepare (text encoding, latents) of newly admitted requests and VAE decode of finished
    # ones on a side worker thread, on CUDA with its own stream, while the engine thread goes on
    # stepping the other requests' denoising (side_lane.py), so a running request's steps no
    # longer wait for a newcomer's encoding or another's decode. None/False: off, every phase on
    # the engine thread in turn (on the CPU the two threads would share the same cores: no
    # gain there). True is refused where it could not act: families run as a whole pipeline (no
    # separate prepare and decode) and cfg_parallel / ulysses_degree > 1 (the follower ranks
    # prepare in step with rank 0's plan).
    overlap_encode_decode: bool | None = None
    # VAE decode one image at a time / in tiles (None: the VAE's own default).
    vae_use_slicing: bool | None = None
    vae_use_tiling: bool | None = None
    # torch.compile the denoising transformer (GPU serving; first steps pay the compile).
    compile_transformer: bool = False
    # Compile each repeated block instead of the whole forward: one graph per block type,
    # so seconds of compile instead of minutes, the same kernels inside the blocks.
    compile_regional: bool = False
    # torch.compile mode (None = default; e.g. "max-autotune-no-cudagraphs") and fullgraph.
    compile_mode: str | None = None
    compile_fullgraph: bool = False
    # torch.compile's `dynamic` for the transformer (None: dynamic for families whose text
    # length changes per prompt, GLM-Image and Qwen-Image; torch's automatic choice otherwise).
    compile_dynamic: bool | None = None
    # Inductor's on-disk cache, kept across restarts (None: compile_cache.py's default).
    compile_cache_dir: str | None = None
    # CUDA graphs over the transformer forward, one per recurring input shape (None: on CUDA).
    cuda_graphs: bool | None = None
    # Most CUDA graphs kept (least recently used evicted); they share one memory pool.
    cuda_graph_max_graphs: int = 8
    # MLP up-projection + tanh-GELU as one GEMM with a GELU epilogue (gelu_epilogue.py;
    # None: on for CUDA devices unless fp8_linear, whose fp8 GEMMs would then skip the fused
    # up-projections). Lossless within bf16 rounding.
    fuse_gelu: bool | None = None
    # fp8 GEMMs (per-row scaled) for the transformer blocks' linears: lossy, opt-in, sm89+.
    fp8_linear: bool = False
    # Benchmark knobs, not in the stage config: neither paid off on the H200 (BENCHMARKS.md).
    # One Q|K|V GEMM instead of three (FLUX); CUDA only, lossless.
    fuse_qkv: bool = False
    # SDPA kernel torch tries first: "cudnn" | "flash" | "efficient" | "math"; None = torch's
    # order (torch 2.11 already picks cuDNN attention on Hopper). CUDA only.
    attention_backend: str | None = None
    # Multi-rank DiT (diffusion/parallel/): cond/uncond rows on two ranks, and the attention
    # sequence split over ulysses_degree ranks; world = (2 if cfg_parallel else 1) * ulysses.
    cfg_parallel: bool = False
    ulysses_degree: int = 1
    # Step caching (the deploy file's `diffusion.step_cache`): the policies requests may choose,
    # the largest threshold and the default policy ({"policies": [...], "max_threshold": x,
    # "default": {"policy": ...}}); None: every step computed, `cache` requests refused.
    step_cache: dict[str, Any] | None = None
    # LoRA adapters per request (the deploy file's `diffusion.lora`): {"dir": folder of adapter
    # folders, "max_loaded": adapters resident on the device, "max_rank": largest rank taken};
    # None: requests naming adapters are refused.
    lora: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return (2 if self.cfg_parallel else 1) * self.ulysses_degree

    @classmethod
    def from_owner(
        cls,
        owner: Any,
        *,
        model: str,
        defaults: dict[str, Any] | None = None,
        pipeline_class: str | None = None,
    ) -> DiffusionEngineConfig:
        """Build from a `DiffusionOwner` (duck-typed: this package imports without the config).

        Every owner field lands in the field of the same name; a field the engine has no slot for
        raises here unless the loader refuses or warns about it (OWNER_FIELDS_NOT_IN_ENGINE), so a
        new owner field cannot be dropped on the way.
        """
        values = owner.model_dump()
        slots = {f.name for f in dataclasses.fields(cls)}
        missing = set(values) - slots - OWNER_FIELDS_NOT_IN_ENGINE
        if missing:
            raise TypeError(f"DiffusionEngineConfig has no field for {sorted(missing)}")
        kwargs = {k: v for k, v in values.items() if k in slots}
        if kwargs.get("device") is None:
            kwargs["device"] = "cuda"
        if kwargs.get("pipeline_class") is None:
            kwargs["pipeline_class"] = pipeline_class
        return cls(model=str(model), defaults=dict(defaults or {}), **kwargs)

    @classmethod
    def from_stage_config(cls, stage: Any) -> DiffusionEngineConfig:
        """Build from the typed StageConfig of a diffusion stage (duck-typed, no import)."""
        sampling = getattr(stage, "sampling", None)
        defaults = sampling.defaults_dict() if hasattr(sampling, "defaults_dict") else {}
        return cls.from_owner(stage.diffusion, model=str(stage.model_path), defaults=defaults)
