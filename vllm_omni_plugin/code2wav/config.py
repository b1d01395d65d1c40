"""The Code2Wav engine's settings (one class: how it loads, batches and chunks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Code2WavEngineConfig:
    #: checkpoint folder with config.json (code2wav_config) and the code2wav.* weights
    model: str
    #: torch device the decoder runs on ("cpu", "cuda", "cuda:1")
    device: str = "cpu"
    #: weights and activations dtype ("float32", "bfloat16", "float16")
    dtype: str = "float32"
    #: most request chunks decoded in one forward
    max_batch_size: int = 64
    #: most requests held at once (their frames wait here until decoded); more are refused
    max_requests: int = 256
    #: frames in a request's first chunk (small: the first audio leaves early)
    first_chunk_frames: int = 4
    #: frames in each later chunk
    chunk_frames: int = 25
    #: frames already decoded that are decoded again in front of a chunk (the decoder's
    #: attention and convolutions look back; more context, closer to the one-shot waveform)
    left_context_frames: int = 25
    #: decode eagerly on CUDA too; otherwise each (batch bucket, window shape) is a CUDA graph
    #: captured at start (see chunk_decoder.py). Off CUDA the decoder always runs eagerly.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager: expected true or false, got {self.enforce_eager!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("max_batch_size", "max_requests", "first_chunk_frames", "chunk_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        # One frame of context at least: the samples a chunk holds back at its end (the causal
        # transposed convolutions need the next frame) come out of the next chunk's context.
        if self.left_context_frames < 1:
            raise ValueError(f"left_context_frames: must be >= 1, got {self.left_context_frames}")
