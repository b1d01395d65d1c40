"""Decode the chunk windows of many requests at the static shapes of `batching.py`.

Windows are grouped by shape (the shortest window length that holds them), each group
right-padded with code 0 to that length and to a batch bucket (padding rows are all code 0),
decoded in one forward and each window's samples cut at its own length. The decoder is causal,
so right padding never reaches the samples kept; the results equal each window decoded alone up
to the kernels' reduction order. On CUDA (unless `enforce_eager`) each (bucket, shape) is a
CUDA graph captured when the engine starts, largest batch first into one memory pool: the first
requests pay no capture, and a GPU too small for `max_batch_size` fails at start, not under
load. Elsewhere the same padded batches run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from .batching import batch_buckets, smallest_fitting
from .decoder import Code2WavDecoder

logger = logging.getLogger("vllm_omni_plugin.code2wav")


class ChunkDecoder:
    def __init__(
        self,
        decoder: Code2WavDecoder,
        shapes: tuple[int, ...],
        max_batch_size: int,
        cuda_graphs: bool,
    ) -> None:
        if cuda_graphs and decoder.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {decoder.device}")
        self.decoder = decoder
        self.shapes = shapes
        self.buckets = batch_buckets(max_batch_size)
        for window in shapes:
            decoder.prepare(window)
        self.graphs: dict[tuple[int, int], object] = {}
        if cuda_graphs:
            self._capture()

    def _capture(self) -> None:
        from .graphs import CapturedDecode

        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), torch.cuda.device(self.decoder.device):
            for batch in sorted(self.buckets, reverse=True):
                for window in sorted(self.shapes, reverse=True):
                    self.graphs[batch, window] = CapturedDecode(self.decoder, batch, window, pool)
            torch.cuda.synchronize()
        logger.info(
            "Code2Wav: %d CUDA graphs (batches %s x windows %s) captured in %.1f s",
            len(self.graphs),
            list(self.buckets),
            list(self.shapes),
            time.perf_counter() - start,
        )

    @property
    def graphed(self) -> bool:
        return bool(self.graphs)

    def plan(self, lengths: list[int]) -> list[tuple[int, int, list[int]]]:
        """(batch bucket, window shape, indices into `lengths`) per forward: windows grouped by
        the shortest shape that holds them, at most the largest bucket per forward."""
        groups: dict[int, list[int]] = {}
        for i, length in enumerate(lengths):
            groups.setdefault(smallest_fitting(length, self.shapes), []).append(i)
        forwards = []
        most = self.buckets[-1]
        for window, members in sorted(groups.items()):
            for lo in range(0, len(members), most):
                part = members[lo : lo + most]
                forwards.append((smallest_fitting(len(part), self.buckets), window, part))
        return forwards

    @torch.inference_mode()
    def decode(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """`windows[i]`: int `[num_groups, T_i]` (T_i at most the longest shape) -> float32 CPU
        `[T_i * 1920 - holdback]` each, as `Code2WavDecoder.decode` gives."""
        dec = self.decoder
        for w in windows:
            if w.dim() != 2 or w.shape[0] != dec.num_groups or not 1 <= w.shape[1]:
                raise ValueError(f"codes: expected [{dec.num_groups}, T>=1], got {list(w.shape)}")
            dec.check_codes(w)
        out: list[torch.Tensor | None] = [None] * len(windows)
        if not self.graphs:
            for batch, window, members in self.plan([w.shape[1] for w in windows]):
                codes = self._padded(windows, batch, window, members)
                wav = dec.forward_static(codes.to(dec.device)).cpu()
                self._cut(wav, windows, members, out)
            return out
        # The graphs replay on the current stream of their device (this may be a worker thread
        # that never selected it).
        with torch.cuda.device(dec.device):
            self._launch_all(windows, out)
        return out

    def _launch_all(self, windows: list[torch.Tensor], out: list) -> None:
        pending: list[tuple[object, list[int]]] = []  # launched graphs not read back yet
        for batch, window, members in self.plan([w.shape[1] for w in windows]):
            codes = self._padded(windows, batch, window, members)
            graph = self.graphs[batch, window]
            if any(g is graph for g, _ in pending):  # its buffers are about to be reused
                self._read_back(pending, windows, out)
            graph.launch(codes)
            pending.append((graph, members))
        self._read_back(pending, windows, out)

    def _padded(self, windows: list, batch: int, window: int, members: list[int]):
        """CPU int `[batch, G, window]`: the members' windows left-aligned, code 0 after."""
        codes = torch.zeros(batch, self.decoder.num_groups, window, dtype=torch.long)
        for row, i in enumerate(members):
            codes[row, :, : windows[i].shape[1]] = windows[i]
        return codes

    def _read_back(self, pending: list, windows: list, out: list) -> None:
        if not pending:
            return
        torch.cuda.current_stream(self.decoder.device).synchronize()
        for graph, members in pending:
            self._cut(graph.host_wav, windows, members, out)
        pending.clear()

    def _cut(self, wav: torch.Tensor, windows: list, members: list[int], out: list) -> None:
        for row, i in enumerate(members):
            out[i] = wav[row, : self.decoder.output_length(windows[i].shape[1])].clone()
