"""The Code2Wav engine: codec frames of many requests in, 24 kHz audio chunks out, batched.

    engine.add_request(rid)
    engine.add_frames(rid, codes, finished=False)   # [num_groups, n] as the talker writes them
    chunks = engine.step()                           # one batched decode of every ready chunk

A request's chunk is ready when `first_chunk_frames` (then `chunk_frames`) new frames wait, or
when its last frames arrived (`finished`). Each chunk is decoded with up to
`left_context_frames` already-decoded frames in front of it. The samples a decode of frames
[w0, F) writes stand at one-shot positions [w0 * 1920, F * 1920 - holdback); a chunk emits from
where the previous one stopped, so its first samples are the `holdback` the previous chunk could
not write yet (they needed this chunk's first frame). Concatenated, a request's chunks have the
one-shot waveform's length and differ from it only where the decoder would have looked further
back than the context (its sliding-window attention spans 72 frames).

A step decodes the windows at two static shapes (`first_chunk_frames`, and
`left_context_frames + chunk_frames`), right-padded and batched to a bucket: CUDA graphs on a
GPU, eager elsewhere (`chunk_decoder.py`).

Thread-safe: `add_request` / `add_frames` / `abort` may come from other threads while one
thread drives `step()`; the lock covers the bookkeeping, not the decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..common.request_table import RequestTable
from .batching import window_shapes
from .chunk_decoder import ChunkDecoder
from .config import Code2WavEngineConfig
from .decoder import Code2WavDecoder

SAMPLE_RATE = 24000


class Code2WavCapacityError(RuntimeError):
    """More requests than `max_requests` at once."""


@dataclass
class AudioChunk:
    request_id: str
    #: float32 mono samples at 24 kHz, in [-1, 1]
    samples: np.ndarray
    #: the request's last chunk
    finished: bool


@dataclass
class _Request:
    frames: list[torch.Tensor] = field(default_factory=list)  # [G, n] pieces not yet merged
    codes: torch.Tensor | None = None  # all frames received, [G, F]
    decoded_frames: int = 0  # frames covered by emitted chunks
    emitted_samples: int = 0  # one-shot positions [0, emitted) already sent
    finished: bool = False  # the talker sent its last frames
    chunks_sent: int = 0
    held: bool = False  # its reader is behind: no decodes until released

    def num_frames(self) -> int:
        pending = sum(f.shape[1] for f in self.frames)
        return pending + (0 if self.codes is None else self.codes.shape[1])


class Code2WavEngine(RequestTable):
    def __init__(self, config: Code2WavEngineConfig, decoder: Code2WavDecoder | None = None):
        super().__init__()
        self.config = config
        self.decoder = decoder or Code2WavDecoder(config.model, config.device, config.dtype)
        self.chunks = ChunkDecoder(
            self.decoder,
            window_shapes(config),
            config.max_batch_size,
            cuda_graphs=self.decoder.device.type == "cuda" and not config.enforce_eager,
        )

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already in the Code2Wav engine")
            if len(self._requests) >= self.config.max_requests:
                raise Code2WavCapacityError(
                    f"Code2Wav engine holds {self.config.max_requests} requests (max_requests)"
                )
            self._requests[request_id] = _Request()

    def add_frames(self, request_id: str, codes, finished: bool = False) -> None:
        """Append frames (`[num_groups, n]` ints, n may be 0) to a request; `finished`: no more."""
        codes = torch.as_tensor(codes, dtype=torch.long).cpu()
        if codes.dim() != 2 or codes.shape[0] != self.decoder.num_groups:
            raise ValueError(
                f"codes: expected [{self.decoder.num_groups}, n], got {list(codes.shape)}"
            )
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                raise KeyError(f"request {request_id!r} is not in the Code2Wav engine")
            if req.finished:
                raise ValueError(f"request {request_id!r} already sent its last frames")
            if codes.shape[1]:
                req.frames.append(codes)
            req.finished = finished

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[AudioChunk]:
        """Decode every ready chunk (up to `max_batch_size`) in one forward; return the chunks."""
        with self._lock:
            plan, out = self._schedule()
        if not plan:
            return out
        windows = [window for _, _, window, _, _ in plan]
        wavs = self.chunks.decode(windows)
        with self._lock:
            for (rid, req, _, w0, end), wav in zip(plan, wavs, strict=True):
                if self._requests.get(rid) is not req:  # aborted meanwhile
                    continue
                # Frames may have arrived during the decode (still in req.frames): count them.
                last = req.finished and end == req.num_frames()
                stop = self.decoder.output_length(end)  # one-shot position the window reaches
                start = req.emitted_samples - w0 * self.decoder.samples_per_frame
                samples = wav[start : stop - w0 * self.decoder.samples_per_frame]
                req.emitted_samples = stop
                req.decoded_frames = end
                req.chunks_sent += 1
                out.append(AudioChunk(rid, samples.numpy().astype(np.float32), last))
                if last:
                    del self._requests[rid]
        return out

    def _schedule(self) -> tuple[list, list[AudioChunk]]:
        """(windows to decode: (rid, request, codes [G, end - w0], w0, end), chunks that need no
        decode: a finished request with no new frames ends with an empty last chunk)."""
        cfg = self.config
        plan, done = [], []
        for rid, req in list(self._requests.items()):
            if len(plan) >= cfg.max_batch_size:
                break
            if req.held:
                continue
            if req.frames:
                parts = ([req.codes] if req.codes is not None else []) + req.frames
                req.codes = torch.cat(parts, dim=1)
                req.frames = []
            total = 0 if req.codes is None else req.codes.shape[1]
            new = total - req.decoded_frames
            want = cfg.first_chunk_frames if req.chunks_sent == 0 else cfg.chunk_frames
            if new >= want:
                end = req.decoded_frames + want
            elif req.finished and new > 0:
                end = total
            elif req.finished:
                # Everything emitted already: one-shot length is decoded_frames * 1920 - holdback,
                # exactly where the previous chunk stopped.
                done.append(AudioChunk(rid, np.zeros(0, np.float32), True))
                del self._requests[rid]
                continue
            else:
                continue
            w0 = max(0, req.decoded_frames - cfg.left_context_frames)
            plan.append((rid, req, req.codes[:, w0:end], w0, end))
        return plan, done
