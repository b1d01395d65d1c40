"""The settings a talker stage reads: vLLM's engine running the talker model, and its frame
sampling defaults. Nothing else of vLLM's engine applies to it (its prompt is embeddings, its
scheduler is vLLM's own, synchronous or async, it runs on one device)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from vllm_omni_plugin.config.owners_common import Owner

# vLLM's own dtype names (ModelConfig.dtype).
_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


class TalkerSettings(Owner):
    """vLLM engine arguments of the talker stage (each handed to its AsyncLLM when set)."""

    dtype: str | None = None
    """Weights and activations dtype ("auto", "bfloat16", "float32", ...)."""
    seed: int | None = None
    """The engine's random seed."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Requests whose next frames are decoded in one step."""
    max_model_len: int | None = Field(None, ge=1)
    """Positions one request takes: prompt ids, the assistant head and one per frame."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Most positions in one engine step (prefills and frames)."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills across steps."""
    async_scheduling: bool | None = None
    """Schedule each step while the previous one runs (unset: vLLM's choice for the platform)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Fraction of the device's memory the engine may use (weights, KV cache, CUDA graphs)."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """Exact KV cache size in bytes: vLLM then skips its free-memory profiling at start-up."""
    block_size: int | None = Field(None, ge=1)
    """Positions per KV cache block."""
    enforce_eager: bool | None = None
    """No CUDA graphs and no torch.compile."""
    compilation_config: dict[str, Any] | None = None
    """vLLM's compilation config of the talker model."""
    max_cudagraph_capture_size: int | None = Field(None, ge=0)
    """Largest batch captured as a CUDA graph (0: none)."""
    cudagraph_capture_sizes: list[int] | None = None
    """Batch sizes captured as CUDA graphs."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        if value is not None and value not in _DTYPES:
            raise ValueError(f"{value!r} is not one of {', '.join(_DTYPES)}")
        return value

    @field_validator("cudagraph_capture_sizes")
    @classmethod
    def _positive_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(size < 1 for size in value):
            raise ValueError(f"{value}: every size must be at least 1")
        return value

    def engine_kwargs(self) -> dict[str, Any]:
        """The set fields, as `vllm.AsyncEngineArgs` keyword arguments."""
        return {k: v for k, v in self.set_fields().items() if v is not None}


class TalkerSamplingDefaults(Owner):
    """Frame sampling defaults of the talker (`default_sampling_params`); a request's own
    speech sampling wins. The frame's other code groups follow the checkpoint's code-predictor
    settings."""

    max_tokens: int | None = Field(None, ge=1)
    """Most codec frames per answer (80 ms each)."""
    min_tokens: int | None = Field(None, ge=0)
    """Frames before the codec's end may end the speech."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature of a frame's first code; 0 is greedy."""
    top_k: int | None = Field(None, ge=-1)
    """Sample from the k most likely codes; -1 or 0 disables."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling mass, in (0, 1]."""
    repetition_penalty: float | None = Field(None, gt=0)
    """Penalty on repeated codes (1.0 = none)."""
    seed: int | None = None
    """Per-request seed."""

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.SamplingParams` (set fields only)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}
