"""The settings a Code2Wav stage reads: where its decoder runs, and how it batches."""

from __future__ import annotations

from pydantic import Field, field_validator

from vllm_omni_plugin.config.owners_common import Owner

_DTYPES = ("float32", "bfloat16", "float16")


class Code2WavSettings(Owner):
    """The Code2Wav engine's deploy settings (code2wav/config.py fixes its chunking)."""

    device: str | None = None
    """torch device of the decoder ("cuda", "cpu"); None: the platform's default."""
    dtype: str = "bfloat16"
    """Weights and activations dtype ("float32", "bfloat16", "float16")."""
    max_batch_size: int = Field(64, ge=1)
    """Most request chunks decoded in one forward (vLLM-Omni's files call it max_num_seqs)."""
    enforce_eager: bool = False
    """Decode eagerly on CUDA too; otherwise one CUDA graph per batch bucket and chunk window,
    captured at start."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in _DTYPES:
            raise ValueError(f"{value!r} is not one of {', '.join(_DTYPES)}")
        return value
