"""Owners only diffusion stages have: the diffusion engine and its sampling defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from vllm_omni_plugin.common.cache_policy import (
    NONE,
    THRESHOLD_LIMIT,
    CacheBounds,
    CachePolicyError,
    parse_cache,
)
from vllm_omni_plugin.config.owners_common import Owner


class StepCacheOwner(Owner):
    """Step caching of a diffusion stage (`step_cache:`): requests choose a policy per request
    with `cache: {policy: first_block, threshold: 0.1}`; this section bounds that choice."""

    policies: list[str] = Field(default_factory=list)
    """Policies requests may choose: first_block, teacache, taylorseer ("none" always is)."""
    max_threshold: float = Field(THRESHOLD_LIMIT, gt=0, le=THRESHOLD_LIMIT)
    """Largest first_block / teacache threshold a request may ask for."""
    default: dict[str, Any] | None = None
    """Policy of requests that send no `cache`, e.g. {policy: first_block, threshold: 0.08}
    (None: every step computed); it must be one of `policies`."""

    @field_validator("policies")
    @classmethod
    def _known_policies(cls, value: list[str]) -> list[str]:
        for name in value:
            try:
                parse_cache({"policy": name})
            except CachePolicyError as exc:
                raise ValueError(f"policies: {exc.message}") from None
        return value

    @model_validator(mode="after")
    def _default_allowed(self) -> StepCacheOwner:
        if self.default is not None:
            bounds = CacheBounds((NONE, *self.policies), self.max_threshold)
            try:
                bounds.check(parse_cache(self.default, "default"), "default")
            except CachePolicyError as exc:
                raise ValueError(str(exc)) from None
        return self


class LoraOwner(Owner):
    """LoRA adapters per request on a diffusion stage (`lora:`): requests name adapters with
    `lora: [{name, scale}]`; each adapter is a folder of diffusers' LoRA format under `dir`."""

    dir: str
    """Folder whose sub-folders are the adapters (the sub-folder's name is the adapter's)."""
    max_loaded: int = Field(4, ge=1, le=256)
    """Most adapters resident on the device at once (least recently used evicted)."""
    max_rank: int = Field(64, ge=1, le=4096)
    """Largest adapter rank accepted; a higher-rank adapter is refused."""

    @field_validator("dir")
    @classmethod
    def _is_folder(cls, value: str) -> str:
        if not Path(value).is_dir():
            raise ValueError(f"{value!r} is not a folder")
        return value


class DiffusionOwner(Owner):
    """The diffusion engine of a stage, and the request bounds it enforces."""

    pipeline_class: str | None = None
    """diffusers pipeline class to run (default: the topology's, else model_index.json's)."""
    dtype: str = "bfloat16"
    """Weights and activations dtype ("bfloat16", "float16", "float32")."""
    device: str | None = None
    """torch device of the stage ("cuda", "cpu"); None: the platform's default."""
    max_batch_size: int = Field(8, ge=1)
    """Most images denoised together in one step."""
    max_num_inference_steps: int = Field(100, ge=1)
    """Most denoising steps one request may ask for."""
    memory_budget_gb: float | None = Field(None, gt=0)
    """Device memory the engine may use, in GiB; requests that can never fit are rejected."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Fraction of the device's memory the engine may use, in (0, 1] (instead of memory_budget_gb):
    the budget requests are checked against, and on CUDA the allocator's hard cap; on CPU a
    fraction of host RAM."""
    min_height: int = Field(256, ge=1)
    """Smallest image height accepted."""
    max_height: int = Field(2048, ge=1)
    """Largest image height accepted."""
    min_width: int = Field(256, ge=1)
    """Smallest image width accepted."""
    max_width: int = Field(2048, ge=1)
    """Largest image width accepted."""
    size_granularity: int | None = Field(None, ge=1)
    """Height and width must be multiples of this (default: the pipeline family's)."""
    max_batch_tokens: int | None = Field(None, ge=1)
    """Most sequence tokens one transformer forward carries over all its rows (CFG rows count):
    a request joins others only while their sum stays within it, and one above it runs alone
    (None: only max_batch_size and the memory budget bound a batch). For shapes so large that
    one request fills the GPU, where sharing a step makes each wait for both."""
    request_batch_max_wait_ms: float | None = Field(None, ge=0, le=60_000)
    """How long an idle engine holds a new request for others to batch with, in ms."""
    enable_cpu_offload: bool | None = None
    """Keep idle components in host memory (not implemented: true is refused)."""
    overlap_encode_decode: bool | None = None
    """Run the text encoding of newly admitted requests and the VAE decode of finished ones on a
    side thread (on CUDA its own stream) while the other requests go on denoising, instead of
    stalling their steps (None: off). Not with cfg_parallel / ulysses_degree > 1."""
    vae_use_slicing: bool | None = None
    """Decode the VAE one image at a time."""
    vae_use_tiling: bool | None = None
    """Decode the VAE in tiles (large images)."""
    compile_transformer: bool = False
    """torch.compile the transformer (GPU: 175 -> 133 ms per FLUX.1-dev step on an H200)."""
    compile_regional: bool = False
    """Compile each repeated transformer block once instead of the whole model (same speed,
    10-16 s of compile instead of 93 s); only with compile_transformer."""
    cfg_parallel: bool = False
    """Run a CFG request's cond and uncond rows on two ranks (processes), combined every step."""
    ulysses_degree: int = Field(1, ge=1, le=64)
    """Ranks one image's attention sequence is split over (Ulysses all-to-all); with
    cfg_parallel the stage runs 2 x ulysses_degree ranks, one per device of `devices` (or gloo
    processes with device: cpu)."""
    compile_dynamic: bool | None = None
    """torch.compile with dynamic shapes (None: on for families whose text length varies per
    prompt, GLM-Image and Qwen-Image, so new prompts never recompile; torch's choice otherwise)."""
    compile_cache_dir: str | None = None
    """Where torch.compile keeps compiled graphs and kernels, so a restarted stage loads them
    instead of compiling again (None: $TORCHINDUCTOR_CACHE_DIR, else
    $VLLM_CACHE_ROOT/omni_inductor, default ~/.cache/vllm/omni_inductor); only with
    compile_transformer."""
    cuda_graphs: bool | None = None
    """Replay the transformer forward from CUDA graphs captured per recurring input shape
    (None: on for CUDA devices; lossless). With `step_cache`, forwards whose rows skip blocks
    (first_block, teacache) run uncaptured."""
    cuda_graph_max_graphs: int = Field(8, ge=1, le=256)
    """Most CUDA graphs kept (least recently used evicted); all share one memory pool."""
    fuse_gelu: bool | None = None
    """The blocks' MLP up-projection and its tanh-GELU as one GEMM (cuBLASLt's GELU epilogue),
    FLUX's single-block output projection without its concatenation (None: on for CUDA devices,
    off with fp8_linear, which quantizes those GEMMs instead). The same function within bf16
    rounding (H200, FLUX.1-dev 1024x1024: 133.4 -> 129.7 ms per step, faster in 10 of 10
    interleaved rounds)."""
    fp8_linear: bool = False
    """fp8 GEMMs with per-row scales for the transformer blocks' linears: faster, lossy (H200,
    FLUX.1-dev 1024x1024: 134 -> 108 ms per step, SSIM 0.9994 against bf16); needs a GPU of
    compute capability 8.9+."""
    step_cache: StepCacheOwner | None = None
    """Step caching (first_block / teacache / taylorseer): which policies requests may choose
    with `cache`, their bounds, and the default of requests that send none (None: off, every
    step computed, a request asking for a policy is refused)."""
    lora: LoraOwner | None = None
    """LoRA adapters per request: the adapter folder, how many stay resident, the largest rank
    (None: off, a request naming an adapter is refused)."""
    cache_backend: str | None = None
    """vLLM-Omni's cache backend: refused at load (set `step_cache` instead)."""
    cache_config: dict[str, Any] | None = None
    """vLLM-Omni's cache backend settings: refused at load (set `step_cache` instead)."""

    @model_validator(mode="after")
    def _bounds(self) -> DiffusionOwner:
        for dim in ("height", "width"):
            lo, hi = getattr(self, f"min_{dim}"), getattr(self, f"max_{dim}")
            if lo > hi:
                raise ValueError(f"min_{dim} ({lo}) is larger than max_{dim} ({hi})")
        if self.fp8_linear and self.device == "cpu":
            raise ValueError("fp8_linear needs a CUDA GPU of compute capability >= 8.9, not cpu")
        if self.step_cache is not None and self.step_cache.policies:
            if self.cfg_parallel or self.ulysses_degree > 1:
                raise ValueError(
                    "step_cache cannot be combined with cfg_parallel or ulysses_degree > 1 "
                    "(the ranks would decide separately which steps to skip)"
                )
            if self.compile_transformer and not self.compile_regional:
                raise ValueError(
                    "step_cache with compile_transformer needs compile_regional: true (the "
                    "per-row decisions sit between the compiled blocks)"
                )
        if self.overlap_encode_decode and (self.cfg_parallel or self.ulysses_degree > 1):
            raise ValueError(
                "overlap_encode_decode cannot be combined with cfg_parallel or ulysses_degree > 1 "
                "(the follower ranks prepare requests in step with rank 0's plan)"
            )
        if self.lora is not None:
            self._lora_combinations()
        if self.memory_budget_gb is not None and self.gpu_memory_utilization is not None:
            raise ValueError(
                "gpu_memory_utilization and memory_budget_gb both set the memory budget; keep one"
            )
        return self

    def _lora_combinations(self) -> None:
        """What LoRA cannot run with: each forward gives the adapted linears a new row plan."""
        clashes = {
            "cfg_parallel": self.cfg_parallel,
            "ulysses_degree > 1": self.ulysses_degree > 1,
            "step_cache": self.step_cache is not None and bool(self.step_cache.policies),
            "compile_transformer": self.compile_transformer,
            "cuda_graphs: true": bool(self.cuda_graphs),
            "fp8_linear": self.fp8_linear,
            "fuse_gelu: true": bool(self.fuse_gelu),
        }
        found = [name for name, on in clashes.items() if on]
        if found:
            raise ValueError(f"lora cannot be combined with {', '.join(found)} (yet); drop one")


class DiffusionSamplingDefaults(Owner):
    """Per-request defaults of a diffusion stage (`default_sampling_params`).

    Unset values fall back to diffusers' own defaults for the pipeline.
    """

    num_inference_steps: int | None = Field(None, ge=1)
    """Denoising steps."""
    guidance_scale: float | None = Field(None, ge=0)
    """Classifier-free guidance scale (mapped to the family's own CFG argument)."""
    true_cfg_scale: float | None = Field(None, ge=0)
    """Qwen-Image's true CFG scale (used with a negative prompt)."""
    height: int | None = Field(None, ge=1)
    """Image height in pixels."""
    width: int | None = Field(None, ge=1)
    """Image width in pixels."""
    seed: int | None = None
    """Seed of the request's torch.Generator("cpu")."""
    negative_prompt: str | None = None
    """Negative prompt used when a request sends none."""
    output_type: Literal["pil"] | None = None
    """diffusers output_type; only "pil" (the stage encodes the response images from PIL)."""
    extra_args: dict[str, Any] | None = None
    """Extra pipeline-call arguments: not supported (the engine runs its own denoising loop), so
    a non-empty mapping is refused."""

    @field_validator("extra_args")
    @classmethod
    def _no_extra_args(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError(
                f"{sorted(value)}: extra pipeline arguments are not supported (the engine runs "
                "its own batched denoising loop); remove them"
            )
        return value

    def defaults_dict(self) -> dict[str, Any]:
        """Set defaults only (the diffusion engine's `defaults`)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}
