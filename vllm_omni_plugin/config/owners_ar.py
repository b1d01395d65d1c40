"""Owners only AR (vLLM engine) stages have: KV cache, scheduler, sampling defaults."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from vllm_omni_plugin.config.owners_common import Owner


class CacheOwner(Owner):
    """KV cache sizing."""

    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Fraction of device memory the engine may use, in (0, 1]."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """Exact KV cache size in bytes: vLLM then skips its free-memory profiling at start-up
    (gpu_memory_utilization is still checked against the free memory), so stages sharing the
    GPU with stated shares start together."""
    enable_prefix_caching: bool | None = None
    """Reuse KV cache across requests sharing a prefix."""
    block_size: int | None = Field(None, ge=1)
    """Tokens per KV cache block."""
    kv_cache_dtype: str | None = None
    """KV cache dtype ("auto", "fp8", ...)."""


class SchedulerOwner(Owner):
    """Batching and the scheduler class; the class and `async_scheduling` always pair up."""

    scheduler_cls: str | None = None
    """Dotted scheduler class; resolved to OmniARScheduler (sync) / OmniARAsyncScheduler (async)."""
    async_scheduling: bool | None = None
    """Overlap scheduling with model execution; resolved from scheduler_cls when unset."""
    max_num_seqs: int | None = Field(None, ge=1)
    """Most sequences decoded together."""
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Most tokens in one engine step."""
    enable_chunked_prefill: bool | None = None
    """Split long prefills across steps."""


class ARSamplingDefaults(Owner):
    """Per-request sampling defaults of an AR stage (`default_sampling_params`)."""

    # vLLM's SamplingParams has more knobs; those pass through in `extra` after a name check.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    temperature: float | None = Field(None, ge=0)
    """Sampling temperature; 0 is greedy."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int | None = Field(None, ge=-1)
    """Sample from the k most likely tokens; -1 or 0 disables."""
    min_p: float | None = Field(None, ge=0, le=1)
    """Minimum probability relative to the most likely token."""
    max_tokens: int | None = Field(None, ge=1)
    """Most tokens generated per request."""
    min_tokens: int | None = Field(None, ge=0)
    """Fewest tokens generated before a stop may end the request."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation."""
    seed: int | None = None
    """Per-request seed."""
    repetition_penalty: float | None = Field(None, gt=0)
    """Penalty on repeated tokens (1.0 = none)."""
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    """OpenAI presence penalty."""
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    """OpenAI frequency penalty."""
    ignore_eos: bool | None = None
    """Keep generating past EOS."""
    detokenize: bool | None = None
    """Turn generated ids into text (off for image-token stages)."""
    skip_special_tokens: bool | None = None
    """Drop special tokens from detokenized text."""
    include_stop_str_in_output: bool | None = None
    """Keep the stop string in the output text."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """Other vLLM SamplingParams fields, passed through unchanged."""

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.SamplingParams` (set fields only)."""
        out = {k: v for k, v in self.model_dump(exclude={"extra"}).items() if v is not None}
        out.update(self.extra)
        return out


# The defaults vLLM's own chat and completion handlers take from a model's generation config
# (ModelConfig.get_diff_sampling_param): all that a chat stage's `default_sampling_params` can set.
CHAT_STAGE_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_tokens",
)


def generation_config_overrides(sampling: ARSamplingDefaults) -> dict[str, Any]:
    """A chat stage's `default_sampling_params` as vLLM's `override_generation_config` (its
    handlers apply them to every request that does not set them; HF calls max_tokens
    max_new_tokens, which vLLM's handlers also take as every request's cap)."""
    out = {k: v for k, v in sampling.sampling_kwargs().items() if k in CHAT_STAGE_DEFAULTS}
    if "max_tokens" in out:
        out["max_new_tokens"] = out.pop("max_tokens")
    return out


# Fields of vllm.SamplingParams (0.32) accepted in `default_sampling_params` beyond the typed ones.
VLLM_SAMPLING_EXTRA = frozenset(
    {
        "n",
        "best_of",
        "stop",
        "logprobs",
        "prompt_logprobs",
        "bad_words",
        "logit_bias",
        "allowed_token_ids",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "output_kind",
        "structured_outputs",
        "extra_args",
        "flat_logprobs",
        "min_tokens",
    }
)
