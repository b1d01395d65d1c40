"""The code predictor's whole frame as one CUDA graph per batch bucket.

A frame's code groups 1.. take 15 sequential sub-steps, each a short dense transformer forward
(a sequence of 2..16 positions), a head and the sampling: on a GPU about a thousand small
kernel launches per talker step, whose host time exceeds their GPU time many times over. With
the sampling noise drawn beforehand (predictor_sampling.py) the frame has static shapes and no
host synchronisation, so each bucket (1, 2, 4, ... rows, and `max_rows`) is captured once and a
step replays the smallest bucket that holds its batch; padding rows compute on stale inputs
and are dropped. A replay gives the codes the eager path gives for the same inputs and noise.

    graphs = PredictorGraphs(talker, max_rows=max_num_seqs)
    graphs.capture(compile_layers=True)           # CUDA only; without it every call runs eagerly
    residual = graphs(hidden, code0, draws)       # [B, G - 1]

The talker's model runner captures them right after vLLM's own CUDA graphs (so after vLLM sized
its KV cache, which they do not take memory from), and not at all where vLLM's graphs are off
(`enforce_eager`, `cudagraph_mode: NONE`) or off CUDA.
"""

from __future__ import annotations

import torch

from .predictor_sampling import (
    PredictorDraws,
    predict_eagerly,
    predict_with_noise,
    predictor_noise_shape,
)


def batch_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... below `max_rows`, then `max_rows`."""
    buckets, size = [], 1
    while size < max_rows:
        buckets.append(size)
        size *= 2
    return buckets + [max_rows]


class PredictorGraphs:
    def __init__(self, model, max_rows: int):
        self.model = model
        self.buckets = batch_buckets(max_rows)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._inputs: tuple[torch.Tensor, ...] = ()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def capture(self, compile_layers: bool = False) -> int:
        """Capture every bucket, the largest first (the smaller ones reuse its memory pool);
        returns the device memory they and their inputs took, in bytes. `compile_layers`:
        the predictor's layers run through torch.compile inside the graphs
        (talker.CodePredictor.compile_hidden), so each replay launches a fraction of the
        kernels; compiled on the first warm-up, before any capture."""
        model = self.model
        weight = model.code_predictor.lm_head[0].weight
        device, rows = weight.device, self.buckets[-1]
        free_before = torch.cuda.mem_get_info(device)[0]
        hidden_size = model.codec_head.weight.shape[1]
        self._inputs = (
            torch.zeros(rows, hidden_size, dtype=weight.dtype, device=device),
            torch.zeros(rows, dtype=torch.long, device=device),
            # Noise of 1 and greedy rows: until a replay's rows are written, every row is a
            # valid (greedy) input.
            torch.ones(predictor_noise_shape(model, rows), dtype=torch.float32, device=device),
            torch.ones(rows, dtype=torch.bool, device=device),
        )
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            if compile_layers:
                # One uncompiled run first: it moves what the layers move lazily (the rotary
                # cache to the activations' dtype), which a compiled graph must not mutate.
                predict_with_noise(self.model, *self._inputs)
                model.code_predictor.compile_hidden()
            for size in reversed(self.buckets):
                self._graphs[size] = self._capture(size, pool)
        torch.cuda.synchronize(device)
        return free_before - torch.cuda.mem_get_info(device)[0]

    def _capture(self, size: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        inputs = [t[:size] for t in self._inputs]
        # Warm up off the capture (cuBLAS workspaces, lazily moved rope caches), on a side
        # stream as torch.cuda.graphs asks.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                predict_with_noise(self.model, *inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            residual = predict_with_noise(self.model, *inputs)
        return graph, residual

    def __call__(
        self, hidden: torch.Tensor, code0: torch.Tensor, draws: PredictorDraws
    ) -> torch.Tensor:
        """Code groups 1.. `[B, G - 1]` of the frames whose first codes `code0` `[B]` the
        talker sampled from `hidden` `[B, H]`, each row choosing as `draws` says."""
        rows = hidden.shape[0]
        size = next((s for s in self.buckets if s >= rows), None)
        if size not in self._graphs:
            return predict_eagerly(self.model, hidden, code0, draws)
        graph, residual = self._graphs[size]
        static_hidden, static_code0, noise, greedy = self._inputs
        static_hidden[:rows].copy_(hidden)
        static_code0[:rows].copy_(code0)
        if draws.greedy is None:
            greedy[:rows] = True
        else:
            greedy[:rows].copy_(draws.greedy)
            draws.fill(noise[:rows])
        graph.replay()
        # A clone: the next replay (of any bucket: they share one memory pool) overwrites it.
        return residual[:rows].clone()
