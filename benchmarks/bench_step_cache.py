"""Step caching: seconds per image, throughput, skipped fraction and distance to the uncached
image, per policy and threshold, on the diffusion engine (and diffusers' own hooks for FLUX).

    # CPU check on a tiny checkpoint (vllm-omni-plugin make-tiny-model flux /tmp/flux):
    .venv/bin/python benchmarks/bench_step_cache.py --model /tmp/flux --size 64 --steps 8 \
        --concurrency 1 2 --device cpu --dtype float32
    # H200 (issue 33): a full-size random-weight pipeline folder, 1024x1024, 50 steps
    python benchmarks/bench_step_cache.py --model DIR --size 1024 --steps 50 --concurrency 1 8

Per (policy, threshold) and concurrency: `s_per_image` (one request alone, wall clock),
`images_per_s` (concurrency requests submitted together, steady state = total images / total
time), `skipped` (fraction of request steps whose transformer call was skipped), `psnr` / `ssim`
(vs the same seed uncached; SSIM is the global, single-window form on 0-255 RGB). Random weights
do not make cache decisions like trained ones: read skip fractions from real checkpoints too.
Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest

ROWS = [
    {"policy": "none"},
    {"policy": "first_block", "threshold": 0.05},
    {"policy": "first_block", "threshold": 0.08},
    {"policy": "first_block", "threshold": 0.12},
    {"policy": "teacache", "threshold": 0.25},
    {"policy": "teacache", "threshold": 0.4},
    {"policy": "teacache", "threshold": 0.6},
    {"policy": "taylorseer", "interval": 3},
    {"policy": "taylorseer", "interval": 5},
]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ma, mb = a.mean(), b.mean()
    va, vb = a.var(), b.var()
    cov = ((a - ma) * (b - mb)).mean()
    return float(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))


def pixels(out) -> np.ndarray:
    return np.asarray(out.images[0].convert("RGB"), dtype=np.float64)


def request(rid: str, seed: int, args, cache: dict) -> GenerationRequest:
    return GenerationRequest(
        rid,
        f"a photo of a cat, variation {seed}",
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        seed=seed,
        cache=cache,
    )


def diffusers_fbc(args, threshold: float) -> float:
    """Seconds per image of diffusers' FluxPipeline with its own FirstBlockCache hook."""
    import torch
    from diffusers import DiffusionPipeline, FirstBlockCacheConfig

    dtype = getattr(torch, args.dtype)
    pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    if threshold > 0:
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    g = torch.Generator("cpu").manual_seed(0)
    call = dict(height=args.size, width=args.size, num_inference_steps=args.steps, generator=g)
    pipe("warm-up", **call)
    t0 = time.perf_counter()
    pipe("a photo of a cat, variation 0", **call)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--diffusers", action="store_true", help="also time diffusers' FBC hook")
    args = ap.parse_args()
    cfg = DiffusionEngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=max(args.concurrency),
        max_num_inference_steps=max(args.steps, 200),
        min_height=args.size,
        min_width=args.size,
        step_cache={"policies": ["first_block", "teacache", "taylorseer"]},
    )
    engine = DiffusionEngine(cfg)
    engine.generate([request("warm-up", 99, args, {"policy": "none"})])
    reference: dict[int, np.ndarray] = {}
    for row in ROWS:
        for conc in args.concurrency:
            before = sum(engine.cache_skipped().values())
            t0 = time.perf_counter()
            alone = engine.generate([request(f"a-{row}-{conc}", 0, args, row)])[0]
            s_alone = time.perf_counter() - t0
            reqs = [request(f"c{i}-{row}-{conc}", i, args, row) for i in range(conc)]
            t0 = time.perf_counter()
            outs = engine.generate(reqs)
            total = time.perf_counter() - t0
            skipped = sum(engine.cache_skipped().values()) - before
            if row["policy"] == "none":
                reference[0] = pixels(alone)
            ref = reference.get(0)
            print(
                json.dumps(
                    {
                        "cache": row,
                        "concurrency": conc,
                        "s_per_image": round(s_alone, 3),
                        "images_per_s": round(conc / total, 3),
                        "skipped": round(skipped / ((conc + 1) * args.steps), 3),
                        "psnr": None if ref is None else round(psnr(pixels(alone), ref), 2),
                        "ssim": None if ref is None else round(ssim(pixels(alone), ref), 4),
                        "errors": [o.error for o in outs if o.error],
                    }
                ),
                flush=True,
            )
    if args.diffusers:
        for threshold in (0.0, 0.05, 0.08, 0.12):
            secs = diffusers_fbc(args, threshold)
            print(json.dumps({"diffusers_first_block": threshold, "s_per_image": round(secs, 3)}))


if __name__ == "__main__":
    main()
