"""The static shapes Code2Wav decodes at: a window length per kind of chunk and batch buckets.

A request's first chunk is `first_chunk_frames` frames with no context; each later one is up to
`left_context_frames + chunk_frames` (a request's last chunk and its second, whose context is
only the first chunk, are shorter). A window is right-padded to the shortest shape that holds it
and a batch of windows to the smallest bucket (1, 2, 4, ... and `max_batch_size`) that holds it,
so the decoder runs at a handful of shapes: each can be a CUDA graph.
"""

from __future__ import annotations

from .config import Code2WavEngineConfig


def window_shapes(config: Code2WavEngineConfig) -> tuple[int, ...]:
    """The window lengths, shortest first: (first chunk, later chunks with their context)."""
    later = config.left_context_frames + config.chunk_frames
    return tuple(sorted({config.first_chunk_frames, later}))


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `max_batch_size`, then `max_batch_size`."""
    buckets, size = [], 1
    while size < max_batch_size:
        buckets.append(size)
        size *= 2
    return (*buckets, max_batch_size)


def smallest_fitting(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` (ascending) that is >= n."""
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"{n} is more than the largest shape {sizes[-1]}")
