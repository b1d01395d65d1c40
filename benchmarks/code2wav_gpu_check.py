"""Code2Wav's chunk decode on a GPU: CUDA graphs against eager, and time per chunk.

No server, no vLLM. For each checkpoint: the chunk decoder at the engine's two window shapes
(a first chunk of 4 frames; 25 new frames with 25 of context) with CUDA graphs captured and
without; the largest |graphs - eager| over random windows of every shape at batch 1, 8 and 32;
the time of one batched decode call and per chunk at those batches, and the audio seconds
decoded per wall second (new frames x 80 ms over the call's time; at batch 32 that is 32
requests' worth of audio). Checkpoints: the tiny one (the project's builder, float32, in a
temporary folder), Code2Wav at the published size with random weights (bfloat16; decode time
does not depend on the weights' values), and `--model DIR` (a real checkpoint, bfloat16).

    python benchmarks/code2wav_gpu_check.py [--model DIR] [--out FILE]

Prints one JSON object (and writes it to FILE). About a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from vllm_omni_plugin.code2wav import Code2WavDecoder, Code2WavEngineConfig
from vllm_omni_plugin.code2wav.batching import window_shapes
from vllm_omni_plugin.code2wav.chunk_decoder import ChunkDecoder

BATCHES = (1, 8, 32)
FRAME_S = 0.08  # one codec frame of audio


def full_size_random(seed: int = 0) -> Code2WavDecoder:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from vllm_omni_plugin.testing.full_qwen3_omni import code2wav_sizes
    from vllm_omni_plugin.testing.tiny_qwen3_omni import make_audible

    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3OmniMoeCode2Wav._from_config(
            Qwen3OmniMoeCode2WavConfig(**code2wav_sizes())
        ).eval()
        make_audible(model, seed + 1)
    return Code2WavDecoder.from_module(model, "cuda", "bfloat16")


def timed(chunks: ChunkDecoder, windows: list[torch.Tensor], repeats: int) -> float:
    """Seconds per `decode` call (it returns after the copy to the host)."""
    for _ in range(2):
        chunks.decode(windows)
    start = time.perf_counter()
    for _ in range(repeats):
        chunks.decode(windows)
    return (time.perf_counter() - start) / repeats


def check(name: str, decoder: Code2WavDecoder, repeats: int) -> dict:
    cfg = Code2WavEngineConfig(model="-", max_batch_size=max(BATCHES))
    shapes = window_shapes(cfg)
    new_frames = {cfg.first_chunk_frames: cfg.first_chunk_frames}
    new_frames[cfg.left_context_frames + cfg.chunk_frames] = cfg.chunk_frames
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    graphed = ChunkDecoder(decoder, shapes, cfg.max_batch_size, cuda_graphs=True)
    capture_s = time.perf_counter() - start
    graph_bytes = torch.cuda.memory_allocated() - before
    eager = ChunkDecoder(decoder, shapes, cfg.max_batch_size, cuda_graphs=False)
    gen = torch.Generator().manual_seed(0)
    rows, worst = [], 0.0
    for window in shapes:
        for batch in BATCHES:
            windows = [
                torch.randint(0, decoder.codebook_size, (decoder.num_groups, window), generator=gen)
                for _ in range(batch)
            ]
            diff = max(
                float((x - y).abs().max())
                for x, y in zip(graphed.decode(windows), eager.decode(windows), strict=True)
            )
            worst = max(worst, diff)
            row = {"window": window, "new_frames": new_frames[window], "batch": batch}
            row["max_abs_diff"] = diff
            for mode, chunks in (("eager", eager), ("graphs", graphed)):
                call_s = timed(chunks, windows, repeats)
                row[f"{mode}_ms_per_call"] = round(call_s * 1e3, 3)
                row[f"{mode}_ms_per_chunk"] = round(call_s * 1e3 / batch, 3)
                audio_s = batch * new_frames[window] * FRAME_S
                row[f"{mode}_audio_s_per_wall_s"] = round(audio_s / call_s, 1)
            rows.append(row)
            print(json.dumps({"checkpoint": name, **row}), flush=True)
    return {
        "dtype": str(decoder.dtype).removeprefix("torch."),
        "capture_s": round(capture_s, 2),
        "graphs": len(graphed.graphs),
        "graph_memory_gib": round(graph_bytes / 2**30, 3),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "graphs_vs_eager_max_abs_diff": worst,
        "rows": rows,
    }


def main() -> None:
    from vllm_omni_plugin.testing.tiny_models import build_tiny_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a full-size Qwen3-Omni checkpoint folder (optional)")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--repeats", type=int, default=10, help="timed decode calls per row")
    args = ap.parse_args()
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model("qwen3-omni", Path(tmp) / "qwen3-omni", seed=0)
        report["tiny"] = check("tiny", Code2WavDecoder(tiny, "cuda", "float32"), args.repeats)
    report["full_size_random"] = check("full_size_random", full_size_random(), args.repeats)
    if args.model:
        decoder = Code2WavDecoder(args.model, "cuda", "bfloat16")
        report["model"] = {"path": args.model, **check("model", decoder, args.repeats)}
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
