"""Step caching: seconds per image, throughput at concurrency N, skipped fraction and
distance to the uncached image, per policy and threshold, on the diffusion engine; then the same
pipeline under diffusers' own cache hooks and cache-dit, where they run.

    # CPU check on a tiny checkpoint (vllm-omni-plugin make-tiny-model flux /tmp/flux):
    .venv/bin/python benchmarks/bench_step_cache.py --model /tmp/flux --size 64 --steps 8 \
        --concurrency 2 --device cpu --dtype float32 --diffusers --out /tmp/sc
    # H200: a full-size random-weight pipeline folder, 1024x1024, 50 steps
    python benchmarks/bench_step_cache.py --model DIR --family flux --out OUT --diffusers
    # the BENCHMARKS.md tables, from what the runs wrote (never copied by hand)
    python benchmarks/step_cache_report.py OUT/results.jsonl --write BENCHMARKS.md

Per cache setting (`--rows`, most important first, so a `--budget-s` cut drops the least
important): `--repeats` requests alone (seed 0; wall clock end to end: text encoding, denoising,
VAE decode), then `--concurrency` requests submitted together (seeds 0..N-1; images per second
= N / wall clock of the batch). `skipped` counts the transformer calls the cache skipped over the
request steps; PSNR / SSIM compare with the uncached image of the same seed (SSIM: the global,
single-window form on 0-255 RGB); `batch_vs_alone_psnr` compares seed 0 in the batch with seed 0
alone under the same setting (inf: identical). diffusers' hooks (`--diffusers`): each setting on
one loaded pipeline, skip fraction from the calls that reach the last block's attention, PSNR vs
diffusers uncached and vs the engine's image under the same setting. Random weights do not make
cache decisions like trained ones: read skip fractions from real checkpoints too (docs/step-cache.md).
Writes one JSON line per setting to OUT/results.jsonl (and stdout).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np

# Most important first: the middle setting of each policy, then the others.
DEFAULT_ROWS = (
    "none",
    "first_block:0.08",
    "teacache:0.4",
    "taylorseer:5",
    "first_block:0.12",
    "teacache:0.6",
    "first_block:0.05",
    "teacache:0.25",
    "taylorseer:3",
)
DEFAULT_HOOKS = (
    "none",
    "first_block:0.05",
    "first_block:0.08",
    "first_block:0.12",
    "taylorseer:5",
    "cache_dit:0.08",
)


def parse_row(spec: str) -> dict:
    """`none`, `first_block:0.08`, `teacache:0.4`, `taylorseer:5` (interval) as a cache dict."""
    policy, _, value = spec.partition(":")
    if policy == "none":
        return {"policy": "none"}
    if policy == "taylorseer":
        return {"policy": policy, "interval": int(value or 5)}
    return {"policy": policy, "threshold": float(value)}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ma, mb = a.mean(), b.mean()
    va, vb = a.var(), b.var()
    cov = ((a - ma) * (b - mb)).mean()
    return float(((2 * ma * mb + c1) * (2 * cov + c2)) / ((ma**2 + mb**2 + c1) * (va + vb + c2)))


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.float64)


def prompt(seed: int) -> str:
    return f"a photo of a cat, variation {seed}"


def _r(x: float | None, nd: int) -> float | None:
    if x is None:
        return None
    return x if x == float("inf") else round(x, nd)


def spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "n": len(values),
    }


class Recorder:
    """Appends each result to OUT/results.jsonl (flushed) and prints it."""

    def __init__(self, out: Path | None, base: dict):
        self.path = None if out is None else out / "results.jsonl"
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        self.base = base

    def __call__(self, rec: dict) -> None:
        line = json.dumps({**self.base, **rec})
        print(line, flush=True)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(line + "\n")


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"cpu (torch {torch.__version__})"


def glm_conditioning(pipe, size: int, seed: int) -> dict:
    """GLM-Image's DiT paints from the AR stage's image tokens: random codes on the AR's 1/32
    grid, upsampled as the pipeline does (seeded: the same for the engine and diffusers), CFG 1.5
    (the pipeline's default). Other families: nothing."""
    import torch

    if type(pipe).__name__ != "GlmImagePipeline":
        return {}
    d32 = size // 32
    gen = torch.Generator("cpu").manual_seed(seed)
    vocab = int(pipe.transformer.config.prior_vq_quantizer_codebook_size)
    codes = torch.randint(0, vocab, (1, d32 * d32), generator=gen)
    return {"prior_token_ids": pipe._upsample_token_ids(codes, d32, d32), "guidance_scale": 1.5}


def run_engine(args, record: Recorder) -> dict[str, np.ndarray]:
    """Every --rows setting on the engine; returns seed 0's image per setting (alone)."""
    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest

    t_load = time.perf_counter()
    engine = DiffusionEngine(
        DiffusionEngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.concurrency,
            max_num_inference_steps=max(args.steps, 200),
            min_height=args.size,
            min_width=args.size,
            step_cache={"policies": ["first_block", "teacache", "taylorseer"], "max_threshold": 1},
            cuda_graphs=args.cuda_graphs == "on",
            compile_transformer=args.compile_regional,
            compile_regional=args.compile_regional,
        )
    )
    load_s = time.perf_counter() - t_load
    pipe = engine.adapter.pipe

    def request(rid: str, seed: int, cache: dict, steps: int | None = None):
        return GenerationRequest(
            rid,
            prompt(seed),
            height=args.size,
            width=args.size,
            num_inference_steps=steps or args.steps,
            seed=seed,
            cache=cache,
            **glm_conditioning(pipe, args.size, seed),
        )

    t0 = time.perf_counter()
    engine.generate([request("warm-up", 99, {"policy": "none"}, steps=4)])
    if args.concurrency > 1:  # the batch's shapes too (compiles, graphs), not in the first row
        warm = [
            request(f"warm-up-{i}", 99, {"policy": "none"}, steps=3)
            for i in range(args.concurrency)
        ]
        engine.generate(warm)
    record({"system": "engine", "event": "loaded", "load_s": round(load_s, 1),
            "warm_up_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
    started = time.perf_counter()
    alone_ref: dict[int, np.ndarray] = {}
    batch_ref: dict[int, np.ndarray] = {}
    seed0: dict[str, np.ndarray] = {}
    row_times: list[float] = []
    for spec in args.rows:
        cache = parse_row(spec)
        elapsed = time.perf_counter() - started
        estimate = statistics.mean(row_times) if row_times else 0.0
        if args.budget_s and elapsed + estimate > args.budget_s:
            record({"system": "engine", "cache": cache, "not_run": "budget",
                    "elapsed_s": round(elapsed, 1)})  # fmt: skip
            continue
        t_row = time.perf_counter()
        before = sum(engine.cache_skipped().values())
        alone_s, alone_img = [], None
        for k in range(args.repeats):
            t0 = time.perf_counter()
            out = engine.generate([request(f"a{k}-{spec}", 0, cache)])[0]
            alone_s.append(time.perf_counter() - t0)
            alone_img = pixels(out.images[0])
        alone_skipped = (sum(engine.cache_skipped().values()) - before) / (
            args.repeats * args.steps
        )
        before = sum(engine.cache_skipped().values())
        reqs = [request(f"c{i}-{spec}", i, cache) for i in range(args.concurrency)]
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        batch_s = time.perf_counter() - t0
        batch_skipped = (sum(engine.cache_skipped().values()) - before) / (
            args.concurrency * args.steps
        )
        batch_imgs = [pixels(o.images[0]) for o in outs if not o.error]
        if cache["policy"] == "none":
            alone_ref[0] = alone_img
            batch_ref.update(enumerate(batch_imgs))
        seed0[spec] = alone_img
        row_times.append(time.perf_counter() - t_row)
        batch_psnr = [psnr(img, batch_ref[i]) for i, img in enumerate(batch_imgs) if i in batch_ref]
        batch_ssim = [ssim(img, batch_ref[i]) for i, img in enumerate(batch_imgs) if i in batch_ref]
        finite = [p for p in batch_psnr if p != float("inf")]
        record(
            {
                "system": "engine",
                "cache": cache,
                "alone_s": spread(alone_s),
                "alone_skipped": round(alone_skipped, 3),
                "psnr": _r(psnr(alone_img, alone_ref[0]), 2) if 0 in alone_ref else None,
                "ssim": _r(ssim(alone_img, alone_ref[0]), 4) if 0 in alone_ref else None,
                "concurrency": args.concurrency,
                "batch_s": round(batch_s, 3),
                "images_per_s": round(len(batch_imgs) / batch_s, 4),
                "batch_skipped": round(batch_skipped, 3),
                "batch_psnr_mean": _r(statistics.mean(finite), 2) if finite else
                (float("inf") if batch_psnr else None),
                "batch_psnr_min": _r(min(batch_psnr), 2) if batch_psnr else None,
                "batch_ssim_mean": _r(statistics.mean(batch_ssim), 4) if batch_ssim else None,
                "batch_vs_alone_psnr": _r(psnr(batch_imgs[0], alone_img), 2)
                if batch_imgs else None,
                "errors": [o.error for o in outs if o.error],
            }
        )  # fmt: skip
    engine = pipe = None  # the weights go before diffusers loads its own copy
    gc.collect()
    _empty_cache()
    return seed0


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _last_attention(transformer):
    """The attention module of the transformer's last block: a skipped step never reaches it."""
    for name in ("single_transformer_blocks", "transformer_blocks", "blocks"):
        blocks = getattr(transformer, name, None)
        if blocks is not None and len(blocks):
            block = blocks[-1]
            return getattr(block, "attn", None) or block.attn1  # GLM-Image's blocks: attn1
    raise TypeError(f"{type(transformer).__name__}: no block list found")


def _apply_hook(pipe, spec: str) -> None:
    policy, _, value = spec.partition(":")
    if policy == "none":
        return
    if policy == "cache_dit":
        import cache_dit

        # cache-dit's DBCache with its own defaults (first 8 blocks computed, 8 warm-up steps).
        cache_dit.enable_cache(
            pipe, cache_config=cache_dit.DBCacheConfig(residual_diff_threshold=float(value))
        )
        return
    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if policy == "first_block":
        config = FirstBlockCacheConfig(threshold=float(value))
    elif policy == "taylorseer":
        config = TaylorSeerCacheConfig(
            cache_interval=int(value), disable_cache_before_step=3, use_lite_mode=True
        )
    else:
        raise ValueError(f"no diffusers hook for {spec}")
    pipe.transformer.enable_cache(config)


def _remove_hook(pipe, spec: str) -> None:
    policy = spec.partition(":")[0]
    if policy == "none":
        return
    if policy == "cache_dit":
        import cache_dit

        cache_dit.disable_cache(pipe)
    else:
        pipe.transformer.disable_cache()


def run_diffusers(args, record: Recorder, engine_seed0: dict[str, np.ndarray]) -> None:
    """Each --hooks setting on one diffusers pipeline, one request at a time (seed 0)."""
    import torch
    from diffusers import DiffusionPipeline

    t0 = time.perf_counter()
    pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype))
    pipe = pipe.to(args.device)
    pipe.set_progress_bar_config(disable=True)
    attn_calls = [0]
    _last_attention(pipe.transformer).register_forward_pre_hook(
        lambda *_: attn_calls.__setitem__(0, attn_calls[0] + 1)
    )

    def call(steps: int):
        g = torch.Generator("cpu").manual_seed(0)
        kw = dict(height=args.size, width=args.size, num_inference_steps=steps, generator=g)
        kw.update(glm_conditioning(pipe, args.size, 0))
        if "prior_token_ids" in kw:
            kw["prior_token_ids"] = kw["prior_token_ids"].to(pipe.device)
        return pipe(prompt(0), **kw).images[0]

    call(4)
    record({"system": "diffusers", "event": "loaded", "load_s": round(time.perf_counter() - t0, 1)})
    started = time.perf_counter()
    reference, calls_uncached = None, None
    row_times: list[float] = []
    for spec in args.hooks:
        elapsed = time.perf_counter() - started
        estimate = statistics.mean(row_times) if row_times else 0.0
        if args.diffusers_budget_s and elapsed + estimate > args.diffusers_budget_s:
            record({"system": "diffusers", "hook": spec, "not_run": "budget"})
            continue
        t_row = time.perf_counter()
        try:
            _apply_hook(pipe, spec)
            secs, calls, img = [], [], None
            for _ in range(args.repeats):
                attn_calls[0] = 0
                t1 = time.perf_counter()
                img = pixels(call(args.steps))
                secs.append(time.perf_counter() - t1)
                calls.append(attn_calls[0])
        except Exception as exc:  # a hook that does not run on this pipeline: say so, go on
            record({"system": "diffusers", "hook": spec, "error": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            try:
                _remove_hook(pipe, spec)
            except Exception:
                pass
        row_times.append(time.perf_counter() - t_row)
        if spec == "none":
            reference, calls_uncached = img, statistics.median(calls)
        mine = engine_seed0.get(spec)
        record(
            {
                "system": "diffusers",
                "hook": spec,
                "alone_s": spread(secs),
                "alone_skipped": round(1 - statistics.median(calls) / calls_uncached, 3)
                if calls_uncached else None,
                "psnr": _r(psnr(img, reference), 2) if reference is not None else None,
                "ssim": _r(ssim(img, reference), 4) if reference is not None else None,
                "psnr_vs_engine": _r(psnr(img, mine), 2) if mine is not None else None,
            }
        )  # fmt: skip
    pipe = None  # free the weights before the caller goes on
    gc.collect()
    _empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--family", default="flux", help="label for the tables")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="requests alone per setting")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS))
    ap.add_argument("--budget-s", type=float, default=0, help="engine rows: stop starting new "
                    "settings once the next would likely end past this many seconds")  # fmt: skip
    ap.add_argument("--diffusers", action="store_true", help="also diffusers' hooks, cache-dit")
    ap.add_argument("--hooks", nargs="+", default=list(DEFAULT_HOOKS))
    ap.add_argument("--diffusers-budget-s", type=float, default=0)
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--compile-regional", action="store_true",
                    help="each transformer block compiled (the served deploy files' setting)")  # fmt: skip
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default="on",
                    help="the engine's CUDA graphs (on: the serving default on a GPU)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    base = {
        "bench": "step_cache",
        "family": args.family,
        "machine": machine(),
        "size": args.size,
        "steps": args.steps,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "cuda_graphs": args.cuda_graphs == "on" and args.device.startswith("cuda"),
        "compile_regional": args.compile_regional,
    }
    record = Recorder(args.out, base)
    seed0 = {} if args.no_engine else run_engine(args, record)
    if args.diffusers:
        run_diffusers(args, record, seed0)


if __name__ == "__main__":
    main()
