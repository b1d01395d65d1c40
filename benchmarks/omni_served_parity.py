"""Qwen3-Omni served on a GPU against transformers on the same GPU: the tiny
checkpoint, greedy, through the official `openai` client. The thinker's token ids (text-only
answer), the speech answer's transcript, and its WAV against transformers'
`generate(..., return_audio=True)` in the same dtype: where the two part (the first token, and the
first 80 ms frame whose samples differ by more than 0.01) and how far.

    python3 benchmarks/omni_served_parity.py --out OUT                  # GPU: bf16, qwen3_omni_1gpu
    python3 benchmarks/omni_served_parity.py --out OUT --stage-config qwen3_omni_tiny \
        --dtype float32 --device cpu                                    # the CPU dry run

bf16 is not expected to equal exactly: greedy picks where two logits are within bf16 rounding
can flip, in either system, and every later token or frame follows the flip. The record says
where that happens; in float32 (the CPU tests) text and frames are equal.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import wave
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_glm import Server, _first_difference  # noqa: E402

PROMPT = "Say hi"
THINKER_TOKENS = 8
FRAMES = 64
SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz


def overrides(dtype: str, gpu: bool) -> dict:
    """The tiny checkpoint on the 1-GPU file: its own contexts, a small share, the frame cap."""
    thinker: dict = {"dtype": dtype, "max_model_len": 2048, "max_num_seqs": 4}
    if gpu:
        thinker["gpu_memory_utilization"] = 0.2
    return {
        "0": thinker,
        # The tiny talker's positions stop at 4096 (the deploy file's default is 8192).
        "1": {
            "dtype": dtype,
            "max_model_len": 1024,
            "default_sampling_params": {"max_tokens": FRAMES},
        },
        "2": {"dtype": dtype},
    }


def compare_waves(served: np.ndarray, reference: np.ndarray, bound: float = 0.01) -> dict:
    """Lengths, max abs difference over the common part, and the first frame (80 ms) holding a
    sample that differs by more than `bound` (None: none does)."""
    n = min(len(served), len(reference))
    diff = np.abs(served[:n] - reference[:n])
    over = np.flatnonzero(diff > bound)
    return {
        "served_samples": int(len(served)),
        "reference_samples": int(len(reference)),
        "max_abs": round(float(diff.max()), 6) if n else None,
        "first_frame_over_bound": int(over[0] // SAMPLES_PER_FRAME) if len(over) else None,
    }


def served_answers(url: str, model: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    ask = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0}
    text = client.chat.completions.create(
        **ask, max_tokens=THINKER_TOKENS, extra_body={"return_token_ids": True}
    ).choices[0]
    audio = (
        client.chat.completions.create(
            **ask,
            max_tokens=THINKER_TOKENS,
            modalities=["text", "audio"],
            audio={"voice": "ethan", "format": "wav"},
        )
        .choices[0]
        .message.audio
    )
    with wave.open(io.BytesIO(base64.b64decode(audio.data))) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), np.int16) / 32768.0
    return {
        "text_ids": list(text.token_ids),
        "text": text.message.content,
        "transcript": audio.transcript,
        "samples": samples,
    }


def reference_answers(model_dir: Path, dtype: str, device: str) -> dict:
    import torch

    from vllm_omni_plugin.testing.qwen3_omni_reference import (
        chat_input_ids,
        load_reference_model,
        reference_generate,
    )

    model = load_reference_model(model_dir, getattr(torch, dtype)).to(device)
    ids = chat_input_ids(model_dir, PROMPT).to(device)
    ref = reference_generate(model, ids, thinker_max_new_tokens=THINKER_TOKENS, max_frames=FRAMES)
    return {"text_ids": ref.text_ids, "frames": int(ref.codes.shape[-1]), "samples": ref.waveform}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=Path("/tmp/tiny-qwen3-omni-parity"))
    ap.add_argument("--stage-config", default="qwen3_omni_1gpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from vllm_omni_plugin.testing.tiny_models import build_tiny_model

    model = build_tiny_model("qwen3-omni", args.model, seed=0)
    gpu = args.device == "cuda"
    argv = [str(model), "--stage-config", args.stage_config]
    argv += ["--stage-overrides", json.dumps(overrides(args.dtype, gpu))]
    server = Server(argv, args.out / "omni_parity_server.log")
    try:
        ready = server.wait_ready(900)
        served = served_answers(server.url, str(model))
    finally:
        server.stop()
    t0 = time.perf_counter()
    ref = reference_answers(model, args.dtype, args.device)
    record = {
        "device": args.device,
        "dtype": args.dtype,
        "stage_config": args.stage_config,
        "ready_s": round(ready, 1),
        "reference_s": round(time.perf_counter() - t0, 1),
        "text_ids_equal": served["text_ids"] == ref["text_ids"],
        "first_differing_token": _first_difference(served["text_ids"], ref["text_ids"]),
        "transcript_is_text_answer": served["transcript"] == served["text"],
        "reference_frames": ref["frames"],
        **compare_waves(served["samples"], ref["samples"]),
    }
    if gpu:
        import torch

        record["gpu"] = torch.cuda.get_device_name(0)
    (args.out / "omni_served_parity.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
