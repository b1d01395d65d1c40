"""AR-stage throughput: our GLM-Image model on stock vLLM vs transformers' generate (CPU).

    .venv/bin/python benchmarks/bench_ar.py [--root TINY_GLM_DIR] [--repeats 3]

Reports generated tokens/s for batch 1 and batch 8 (vLLM: offline LLM, enforce_eager,
OmniARAsyncScheduler, the t2i grid constraint; transformers: `generate` with the processor's
inputs, greedy, batch 8 left-padded as diffusers does). Every request writes a full 64x64 grid
(16x16 preview + 2x2 large + EOS = 261 tokens). Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

PROMPT = "a red cat"
HEIGHT = WIDTH = 64


def _best(fn, repeats: int) -> tuple[float, int]:
    """(seconds of the fastest run, tokens it generated) after one warm-up run."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        runs.append((time.perf_counter() - t0, tokens))
    return min(runs)


def bench_vllm(root: Path, repeats: int) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.families.glm_image.processing import (
        build_t2i_prompt,
        t2i_sampling_overrides,
    )
    from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR

    ar, proc = str(root / "vision_language_encoder"), str(root / "processor")
    t0 = time.perf_counter()
    llm = LLM(
        model=ar,
        tokenizer=proc,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        scheduler_cls="vllm_omni_plugin.core.sched.OmniARAsyncScheduler",
        logits_processors=[LOGITS_PROCESSOR],
    )
    startup = time.perf_counter() - t0
    prompt = {"prompt_token_ids": build_t2i_prompt(proc, PROMPT, HEIGHT, WIDTH)}
    params = SamplingParams(temperature=0, **t2i_sampling_overrides(ar, HEIGHT, WIDTH))

    def run(batch: int) -> int:
        outs = llm.generate([prompt] * batch, [params] * batch, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    result = {"vllm_startup_s": round(startup, 1)}
    for batch in (1, 8):
        seconds, tokens = _best(lambda b=batch: run(b), repeats)
        result[f"vllm_b{batch}_tok_s"] = round(tokens / seconds, 1)
    llm.llm_engine.engine_core.shutdown()
    return result


def bench_transformers(root: Path, repeats: int) -> dict[str, float]:
    import torch
    from transformers import AutoProcessor, GlmImageForConditionalGeneration

    from vllm_omni_plugin.families.glm_image.processing import num_image_tokens

    model = GlmImageForConditionalGeneration.from_pretrained(root / "vision_language_encoder")
    model.eval()
    processor = AutoProcessor.from_pretrained(root / "processor")
    budget = num_image_tokens(HEIGHT, WIDTH) + 1

    def run(batch: int) -> int:
        inputs = processor.apply_chat_template(
            [[{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]] * batch,
            tokenize=True,
            padding=batch > 1,
            target_h=HEIGHT,
            target_w=WIDTH,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=budget, do_sample=False)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * batch

    result = {}
    for batch in (1, 8):
        seconds, tokens = _best(lambda b=batch: run(b), repeats)
        result[f"hf_b{batch}_tok_s"] = round(tokens / seconds, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="tiny GLM-Image folder (built if omitted)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = args.root
    if root is None:
        from vllm_omni_plugin.testing.tiny_models import build_tiny_model

        root = build_tiny_model("glm-image", Path(tempfile.mkdtemp()) / "glm-image", seed=0)
    result = {"model": "tiny GLM-Image AR (2 layers, hidden 64)", "tokens_per_request": 261}
    result.update(bench_vllm(root, args.repeats))
    result.update(bench_transformers(root, args.repeats))
    result["vllm_b8_over_b1"] = round(result["vllm_b8_tok_s"] / result["vllm_b1_tok_s"], 2)
    result["vllm_over_hf_b1"] = round(result["vllm_b1_tok_s"] / result["hf_b1_tok_s"], 2)
    result["vllm_over_hf_b8"] = round(result["vllm_b8_tok_s"] / result["hf_b8_tok_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
