"""The talker's decode step as CUDA graphs: one step is ~100 layer passes of small kernels (20
talker layers, then 15 sub-steps of the 5-layer code predictor), thousands of launches that
would each cost more host time than GPU time. A replay launches them all at once.

    decode = DecodeGraphs(runner, max_batch_size=64)
    frames, hidden, codes = decode(last_hidden, code0, text, slots, positions)  # as runner.decode

One graph per batch size in `sizes` (1, 2, 4, ..., max_batch_size), all captured by
`capture_all()` (the engine calls it at start, so a capture that fails fails the start); a batch
runs in the smallest that holds it, its padding rows writing the cache's scratch slot. Graphs read
the cache's tensors as captured: when the cache grows (`generation` changes) they are dropped
and each is captured again on its next use.
"""

from __future__ import annotations

import torch

from .runner import TalkerRunner


def batch_sizes(max_batch_size: int) -> list[int]:
    sizes, size = [], 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch_size]


class DecodeGraphs:
    def __init__(self, runner: TalkerRunner, max_batch_size: int):
        self.runner = runner
        self.sizes = batch_sizes(max_batch_size)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple, tuple]] = {}
        self._generation = runner.cache.generation
        self._pool = torch.cuda.graph_pool_handle()

    def capture_all(self) -> None:
        for size in self.sizes:
            self._graphs[size] = self._capture(size)

    def __call__(self, last_hidden, code0, text, slots, positions):
        if self.runner.cache.generation != self._generation:
            self._graphs.clear()
            # A pool whose graphs are all gone is released: capturing into it again fails.
            self._pool = torch.cuda.graph_pool_handle()
            self._generation = self.runner.cache.generation
        n = last_hidden.shape[0]
        size = next(s for s in self.sizes if s >= n)
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, inputs, outputs = self._graphs[size]
        for static, value in zip(inputs, (last_hidden, code0, text, slots, positions), strict=True):
            static[:n].copy_(value)
        inputs[3][n:] = self.runner.cache.scratch  # padding rows: the scratch slot, position 0
        inputs[4][n:] = 0
        graph.replay()
        # Clones: the next replay (of any size: they share one memory pool) overwrites these.
        return tuple(out[:n].clone() for out in outputs)

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, tuple, tuple]:
        r = self.runner
        hidden_size = r.model.get_input_embeddings().weight.shape[1]
        dtype, device = r.cache.keys.dtype, r.device
        inputs = (
            torch.zeros(size, hidden_size, dtype=dtype, device=device),
            torch.zeros(size, dtype=torch.long, device=device),
            torch.zeros(size, hidden_size, dtype=dtype, device=device),
            torch.full((size,), r.cache.scratch, dtype=torch.long, device=device),
            torch.zeros(size, dtype=torch.long, device=device),
        )
        # Warm up off the capture (cuBLAS workspaces, lazy module state), on a side stream as
        # torch.cuda.graphs asks; every row writes the scratch slot.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                r.decode(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = r.decode(*inputs)
        return graph, inputs, outputs
