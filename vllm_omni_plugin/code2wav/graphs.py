"""One CUDA graph of the Code2Wav decoder at one (batch, window) shape, with its buffers.

The codes go host -> pinned buffer -> the graph's device input, the graph replays, its float32
waveform goes back to a pinned host buffer; all three are queued on the current stream without
waiting, so a step launches every shape's graph and then waits once (`torch.cuda` synchronize
by the caller) before reading `host_wav`.
"""

from __future__ import annotations

import torch

from .decoder import Code2WavDecoder


class CapturedDecode:
    def __init__(self, decoder: Code2WavDecoder, batch: int, window: int, pool) -> None:
        device = decoder.device
        shape = (batch, decoder.num_groups, window)
        self.batch, self.window = batch, window
        self.codes = torch.zeros(shape, dtype=torch.long, device=device)
        self.host_codes = torch.zeros(shape, dtype=torch.long, pin_memory=True)
        self.host_wav = torch.zeros(
            batch, decoder.output_length(window), dtype=torch.float32, pin_memory=True
        )
        decoder.prepare(window)
        # Warm up on a side stream first (library handles, kernel choices), as capture needs.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                decoder.forward_static(self.codes)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.wav = decoder.forward_static(self.codes)

    def launch(self, codes: torch.Tensor) -> None:
        """Queue the decode of `codes` (CPU int `[batch, G, window]`): copy in, replay, copy
        out to `host_wav`. The caller synchronizes before reading `host_wav` and before the
        next `launch` of this graph (the pinned buffers are reused)."""
        self.host_codes.copy_(codes)
        self.codes.copy_(self.host_codes, non_blocking=True)
        self.graph.replay()
        self.host_wav.copy_(self.wav, non_blocking=True)
