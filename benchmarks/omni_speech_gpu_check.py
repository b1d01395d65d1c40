"""Qwen3-Omni's speech engines on a GPU against transformers on the same GPU (the
part that needs no vLLM): the tiny checkpoint, greedy; the talker's codec frames (exact match or
the first frame where they part) and the waveform's distance, in float32 and in bfloat16, plus the
engines' time per talker step at batch 1 and 8.

    python3 benchmarks/omni_speech_gpu_check.py --out DIR      # writes DIR/omni_speech_gpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from vllm_omni_plugin.models.qwen3_omni import SpeechGenerator
from vllm_omni_plugin.testing.qwen3_omni_reference import (
    chat_input_ids,
    load_reference_model,
    reference_generate,
)
from vllm_omni_plugin.testing.tiny_models import build_tiny_model

PROMPTS = ["Say hello.", "Hi", "Count to three", "What is blue?"]


def run(gen: SpeechGenerator, requests: dict[str, tuple[list[int], list[int]]], frames: int):
    for rid, (prompt, text) in requests.items():
        gen.add_request(rid, prompt, voice="ethan", max_frames=frames)
        gen.add_text(rid, text, finished=True)
    codes = {rid: [] for rid in requests}
    audio = {rid: [] for rid in requests}
    steps, t0 = 0, time.perf_counter()
    while gen.has_unfinished():
        for out in gen.step():
            codes[out.request_id].append(out.codes)
            audio[out.request_id].append(out.audio)
        steps += 1
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    return (
        {r: torch.cat(c, 1) for r, c in codes.items()},
        {r: np.concatenate(a) for r, a in audio.items()},
        took / max(steps, 1),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--frames", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model("qwen3-omni", Path("/tmp/tiny-qwen3-omni"), seed=0)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    for dtype in ("float32", "bfloat16"):
        ref_model = load_reference_model(model_dir, getattr(torch, dtype)).to("cuda")
        refs, requests = {}, {}
        for i, text in enumerate(PROMPTS):
            ids = chat_input_ids(model_dir, text).to("cuda")
            refs[f"r{i}"] = reference_generate(
                ref_model, ids, thinker_max_new_tokens=8, max_frames=args.frames
            )
            requests[f"r{i}"] = (ids[0].tolist(), refs[f"r{i}"].text_ids)
        del ref_model
        gen = SpeechGenerator(str(model_dir), device="cuda", dtype=dtype)
        run(gen, {"warm": requests["r0"]}, 8)
        for batch in (1, len(PROMPTS)):
            subset = dict(list(requests.items())[:batch])
            codes, audio, step_s = run(gen, subset, args.frames)
            for rid in subset:
                ref = refs[rid]
                mine = codes[rid]
                n = min(mine.shape[1], ref.codes.shape[1])
                same = (mine[:, :n].cpu() == ref.codes[:, :n].cpu()).all(0)
                first_diff = int((~same).nonzero()[0]) if not bool(same.all()) else None
                m = min(len(audio[rid]), len(ref.waveform))
                report["rows"].append(
                    {
                        "dtype": dtype,
                        "batch": batch,
                        "request": rid,
                        "frames": [int(mine.shape[1]), int(ref.codes.shape[1])],
                        "frames_equal": first_diff is None and mine.shape == ref.codes.shape,
                        "first_differing_frame": first_diff,
                        "wave_max_abs": float(np.abs(audio[rid][:m] - ref.waveform[:m]).max())
                        if m
                        else None,
                        "step_ms": round(step_s * 1000, 2),
                    }
                )
                print(json.dumps(report["rows"][-1]), flush=True)
    (out / "omni_speech_gpu.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
