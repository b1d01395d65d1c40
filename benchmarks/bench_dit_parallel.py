"""Multi-rank DiT scaling: 1 vs 2 vs 4 ranks per image, step time and end to end.

    python benchmarks/bench_dit_parallel.py --out DIR            # 4 GPUs: full sizes
    python benchmarks/bench_dit_parallel.py --tiny --out DIR     # CPU (gloo): checks the code

Models (random weights, built once on GPU 0 and saved under --models, default DIR/models, so
every rank loads the same checkpoint; no downloads, no vLLM):
  * FLUX.1-dev-size pipeline (benchmarks/diffusion_models.py: 19 + 38 blocks, 24 heads x 128,
    small random text encoders, FLUX-size VAE), guidance-distilled: no CFG, so its ranks are
    Ulysses only (2: ulysses 2; 4: ulysses 4).
  * GLM-Image DiT stage at the published size (30 layers, 32 heads x 128, 6.9B) with CFG
    (guidance 1.5) and random prior ids: 2 ranks = cfg_parallel, 4 = cfg_parallel x ulysses 2 (and ulysses 4).
Both at 1024x1024, one image per request (latency: batching gains nothing at this size).

Per layout: the engine (diffusion/parallel.build_engine, the stage's own code) serves a warm-up,
then requests of STEPS and of 2 steps; end to end = the STEPS request's wall time (text encode,
denoise, VAE decode; queueing excluded), step = (T(STEPS) - T(2)) / (STEPS - 2), which cancels
encode and decode. Speed-up = one rank's time / this layout's. One-rank baselines run both with
CUDA graphs (the single-GPU default) and without (ranks > 1 run without graphs, see
parallel/ranks.py), so the table separates the graph gain from the parallel gain.
Prints a markdown table and writes DIR/results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_omni_plugin.diffusion import DiffusionEngineConfig, GenerationRequest  # noqa: E402
from vllm_omni_plugin.diffusion.parallel import build_engine  # noqa: E402

# family -> [(label, cfg_parallel, ulysses_degree, cuda_graphs)]
LAYOUTS = {
    "flux": [
        ("1 rank, graphs", False, 1, True),
        ("1 rank", False, 1, False),
        ("2: ulysses 2", False, 2, False),
        ("4: ulysses 4", False, 4, False),
    ],
    "glm": [
        ("1 rank, graphs", False, 1, True),
        ("1 rank", False, 1, False),
        ("2: cfg", True, 1, False),
        ("4: cfg x ulysses 2", True, 2, False),
        ("4: ulysses 4", False, 4, False),
    ],
}


def build_models(root: Path, tiny: bool, families: list[str], smoke: bool) -> dict[str, Path]:
    out = {}
    for fam in families:
        path = root / fam
        out[fam] = path
        if (path / "model_index.json").exists():
            continue
        t0 = time.perf_counter()
        if tiny:
            from vllm_omni_plugin.testing.tiny_models import build_tiny_model

            build_tiny_model("flux" if fam == "flux" else "glm-image", path, seed=0)
        else:
            from diffusion_models import flux_pipe, glm_pipe

            gpu = torch.cuda.is_available()
            device = torch.device("cuda", 0) if gpu else torch.device("cpu")
            dtype = torch.bfloat16 if gpu else torch.float32
            if fam == "flux":
                pipe = flux_pipe("full", device, dtype, smoke=smoke)
            else:
                pipe = glm_pipe(device, dtype, smoke=True)  # its DiT is replaced just below
                pipe.register_modules(transformer=served_glm_dit(device, dtype, smoke))
            pipe.save_pretrained(path)
            del pipe
            torch.cuda.empty_cache()
        print(f"built {fam} in {time.perf_counter() - t0:.0f} s -> {path}", flush=True)
    return out


def served_glm_dit(device: torch.device, dtype: torch.dtype, smoke: bool = False):
    """GLM-Image's DiT at the published size (32 heads x 128, 6.9B; testing/full_glm_image.py),
    not diffusers' default config (64 x 40, 2.4B) that glm_pipe builds."""
    from diffusers import GlmImageTransformer2DModel

    from vllm_omni_plugin.testing.full_glm_image import DIT

    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            return GlmImageTransformer2DModel(**{**DIT, **({"num_layers": 1} if smoke else {})})
    finally:
        torch.set_default_dtype(prev)


def request(engine, fam: str, rid: str, size: int, steps: int) -> GenerationRequest:
    kw: dict = {}
    if fam == "glm":
        ad = engine.adapter
        grid = (size // (ad.vae_scale_factor * ad.patch)) ** 2  # prior ids the DiT expects
        vocab = int(ad.pipe.transformer.config.prior_vq_quantizer_codebook_size)
        gen = torch.Generator().manual_seed(0)
        kw.update(prior_token_ids=torch.randint(0, vocab, (1, grid), generator=gen))
        kw.update(guidance_scale=1.5)
    else:
        kw.update(guidance_scale=3.5)
    return GenerationRequest(
        rid, 'a shop sign saying "open late"', height=size, width=size,
        num_inference_steps=steps, seed=0, **kw,
    )  # fmt: skip


def wall_s(engine, req: GenerationRequest) -> float:
    t0 = time.perf_counter()
    (out,) = engine.generate([req])
    if out.error:
        raise RuntimeError(out.error)
    return time.perf_counter() - t0


def measure(engine, fam: str, args) -> dict:
    wall_s(engine, request(engine, fam, "warm", args.size, 2))
    long_s = min(
        wall_s(engine, request(engine, fam, f"long{i}", args.size, args.steps))
        for i in range(args.repeats)
    )
    short_s = min(
        wall_s(engine, request(engine, fam, f"short{i}", args.size, 2)) for i in range(args.repeats)
    )
    return {
        "end_to_end_s": long_s,
        "step_ms": 1e3 * (long_s - short_s) / (args.steps - 2),
        "fixed_s": short_s - 2 * (long_s - short_s) / (args.steps - 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (gloo)")
    ap.add_argument(
        "--smoke", action="store_true", help="full shapes, one block each (checks the full path)"
    )
    ap.add_argument("--families", default="flux,glm")
    ap.add_argument("--max-ranks", type=int, default=None, help="skip layouts above this")
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    args.size = args.size or (64 if args.tiny else 1024)
    args.steps = args.steps or (6 if args.tiny else 28)
    gpus = torch.cuda.device_count()
    max_ranks = args.max_ranks or (gpus if gpus and not args.tiny else 4)
    args.out.mkdir(parents=True, exist_ok=True)
    families = args.families.split(",")
    models = build_models(args.models or args.out / "models", args.tiny, families, args.smoke)
    on_gpu = torch.cuda.is_available() and not args.tiny
    rows = []
    for fam in families:
        base = DiffusionEngineConfig(
            model=str(models[fam]),
            device="cuda" if on_gpu else "cpu",
            dtype="bfloat16" if on_gpu else "float32",
            max_batch_size=1,
            max_height=args.size,
            max_width=args.size,
        )
        for label, cfg, uly, graphs in LAYOUTS[fam]:
            config = dataclasses.replace(
                base, cfg_parallel=cfg, ulysses_degree=uly, cuda_graphs=graphs and on_gpu
            )
            if config.world_size > max_ranks:
                print(f"skip {fam} {label}: {config.world_size} ranks > {max_ranks}", flush=True)
                continue
            t0 = time.perf_counter()
            try:
                engine = build_engine(config)
            except ValueError as exc:  # e.g. a tiny model's 2 heads and ulysses 4
                print(f"skip {fam} {label}: {exc}", flush=True)
                continue
            start_s = time.perf_counter() - t0
            try:
                row = {"family": fam, "layout": label, "ranks": config.world_size}
                row.update(measure(engine, fam, args), start_s=start_s)
            finally:
                if getattr(engine, "ranks", None) is not None:
                    engine.ranks.close()
                del engine
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    for fam in families:
        one = next((r for r in rows if r["family"] == fam and r["layout"] == "1 rank"), None)
        for r in rows:
            if r["family"] == fam and one:
                r["step_speedup"] = one["step_ms"] / r["step_ms"]
                r["e2e_speedup"] = one["end_to_end_s"] / r["end_to_end_s"]
    result = {
        "machine": platform.node(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "torch": torch.__version__,
        "size": args.size,
        "steps": args.steps,
        "tiny": args.tiny,
        "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.size}x{args.size}, {args.steps} steps, one image per request\n")
    print("| model | layout | ranks | step ms | x | end to end s | x | start s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['layout']} | {r['ranks']} | {r['step_ms']:.1f} | "
            f"{r.get('step_speedup', 0):.2f} | {r['end_to_end_s']:.2f} | "
            f"{r.get('e2e_speedup', 0):.2f} | {r['start_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
