"""Diffusion engine vs diffusers' own pipeline, side by side on the same weights and settings.

    python benchmarks/bench_diffusion.py                      # CPU: tiny + small FLUX configs
    python benchmarks/bench_diffusion.py --config tiny --model DIR   # tiny from make-tiny-model
    python benchmarks/bench_diffusion.py --gpu                # full-size FLUX.1-dev + GLM-Image DiT

Needs only torch + diffusers + transformers + this package (no vLLM). All weights are random
and built in-process (no downloads); GPU configs are built directly on the GPU in bf16.

Measured per config:
  * latency at concurrency 1: one request at a time (best of --repeats: the CPU machine is
    shared, and the minimum is the statistic least moved by other people's load);
  * images/s at concurrency 8: 8 requests (different prompts and seeds) in flight. diffusers
    serves them one pipeline call each (what a diffusers-backed server does); the engine gets
    all 8 at once and batches them step by step;
  * GPU configs also: one denoising step, transformer only, batch 1: diffusers eager forward
    vs the engine's denoise step (eager, and torch.compile with --compile);
  * max |engine - diffusers| mean pixel difference over the compared images (sanity).
Prints a table, then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np
import torch
from bench_step_variants import step_variants
from diffusion_models import PROMPTS, flux_pipe, glm_pipe, sync, tiny_flux_pipe

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.adapters.flux import FluxAdapter
from vllm_omni_plugin.diffusion.adapters.glm_image import GlmImageAdapter

# dit_end_to_end.py (bench_dit_gpu.py) imports pixel_diff from here.
__all__ = ["flux_pipe", "pixel_diff", "run_case"]


# ---- measurement ------------------------------------------------------------------------
class Case:
    """One config: a pipeline, an engine sharing its weights, and how to call each."""

    def __init__(self, name, pipe, adapter_cls, size, steps, device, dtype, compile_=False):
        self.name, self.pipe, self.size, self.steps = name, pipe, size, steps
        self.device, self.dtype = device, dtype
        self.glm = adapter_cls is GlmImageAdapter
        adapter = adapter_cls(pipe, device, dtype, {})
        self.engine = DiffusionEngine(
            DiffusionEngineConfig(
                model=name,
                device=str(device),
                dtype=str(dtype).split(".")[-1],
                max_batch_size=8,
                compile_transformer=compile_,
            ),
            adapter=adapter,
        )
        grid = size // 16
        gen = torch.Generator("cpu").manual_seed(0)
        codebook = pipe.transformer.config.get("prior_vq_quantizer_codebook_size", 16384)
        self.priors = [
            torch.randint(0, codebook, (1, grid * grid), generator=gen) for _ in range(8)
        ]
        self._n = 0

    def request(self, i: int) -> GenerationRequest:
        self._n += 1
        return GenerationRequest(
            f"r{self._n}",
            PROMPTS[i % len(PROMPTS)],
            height=self.size,
            width=self.size,
            num_inference_steps=self.steps,
            guidance_scale=1.5 if self.glm else 3.5,
            seed=i,
            prior_token_ids=self.priors[i % 8] if self.glm else None,
        )

    def diffusers(self, r: GenerationRequest):
        kw = {"prior_token_ids": r.prior_token_ids.to(self.device)} if self.glm else {}
        return self.pipe(
            r.prompt,
            height=r.height,
            width=r.width,
            num_inference_steps=r.num_inference_steps,
            guidance_scale=r.guidance_scale,
            generator=torch.Generator("cpu").manual_seed(r.seed),
            **kw,
        ).images[0]

    def timed(self, fn):
        sync(self.device)
        t = time.perf_counter()
        out = fn()
        sync(self.device)
        return time.perf_counter() - t, out


def pixel_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).mean())


def run_case(case: Case, repeats: int, step_time: bool, compile_: bool = False) -> dict:
    # Warm-up both paths (allocator, lazy inits, compile).
    case.diffusers(case.request(0))
    case.engine.generate([case.request(0)])
    if case.device.type == "cuda":  # batch-8 shapes get their kernels/allocations before timing
        case.engine.generate([case.request(i) for i in range(8)])
    lat_d, lat_e, diffs = [], [], []
    for i in range(repeats):  # interleaved, so machine noise hits both alike
        r = case.request(i)
        dt, img_d = case.timed(lambda r=r: case.diffusers(r))
        lat_d.append(dt)
        dt, (out,) = case.timed(lambda r=r: case.engine.generate([r]))
        lat_e.append(dt)
        diffs.append(pixel_diff(img_d, out.images[0]))
    tput_d, tput_e = [], []
    for _ in range(repeats):
        reqs = [case.request(i) for i in range(8)]
        dt, imgs_d = case.timed(lambda reqs=reqs: [case.diffusers(r) for r in reqs])
        tput_d.append(8 / dt)
        dt, outs = case.timed(lambda reqs=reqs: case.engine.generate(reqs))
        tput_e.append(8 / dt)
        diffs += [pixel_diff(a, o.images[0]) for a, o in zip(imgs_d, outs, strict=True)]
    res = {
        "config": case.name,
        "size": case.size,
        "steps": case.steps,
        "dtype": str(case.dtype),
        "c1_latency_s": {"diffusers": min(lat_d), "engine": min(lat_e)},
        "c8_images_per_s": {"diffusers": max(tput_d), "engine": max(tput_e)},
        "c1_latency_median_s": {
            "diffusers": statistics.median(lat_d),
            "engine": statistics.median(lat_e),
        },
        "c8_images_per_s_median": {
            "diffusers": statistics.median(tput_d),
            "engine": statistics.median(tput_e),
        },
        "max_mean_pixel_diff": max(diffs),
    }
    res["c1_speedup"] = res["c1_latency_s"]["diffusers"] / res["c1_latency_s"]["engine"]
    res["c8_speedup"] = res["c8_images_per_s"]["engine"] / res["c8_images_per_s"]["diffusers"]
    print(json.dumps(res), flush=True)
    if step_time:
        res["step_ms"] = transformer_step_ms(case, compile_)
    return res


def transformer_step_ms(case: Case, compile_: bool, iters: int = 10) -> dict:
    """One denoising step at batch 1: diffusers' transformer forward vs the engine's step."""
    eng, adapter = case.engine, case.engine.adapter
    r = eng.add_request(case.request(0))
    eng.step()  # encode + first step: the state now holds real inputs
    state = eng.scheduler.find(r.request_id)
    latents = state.latents

    def engine_step():
        state.step, state.latents = 0, latents
        adapter.denoise([state])

    p = case.pipe
    emb = state.cond["embeds"]
    if case.glm:
        # As diffusers' GLM loop: inputs built once, the latents cast to the transformer dtype.
        kw = dict(
            hidden_states=latents.to(p.transformer.dtype),
            encoder_hidden_states=emb,
            prior_token_id=state.cond["prior"],
            prior_token_drop=torch.zeros_like(state.cond["prior"], dtype=torch.bool),
            timestep=state.timesteps[:1] - 1,
            target_size=torch.tensor([[case.size, case.size]], dtype=emb.dtype, device=case.device),
            crop_coords=torch.zeros(1, 2, dtype=emb.dtype, device=case.device),
            return_dict=False,
        )
    else:
        h = case.size // 16
        kw = dict(
            hidden_states=latents,
            timestep=state.timesteps[:1].to(latents.dtype) / 1000,
            guidance=torch.full([1], 3.5, device=case.device, dtype=torch.float32),
            pooled_projections=state.cond["pooled"],
            encoder_hidden_states=emb,
            txt_ids=torch.zeros(emb.shape[1], 3, device=case.device, dtype=latents.dtype),
            img_ids=p._prepare_latent_image_ids(1, h, h, case.device, latents.dtype),
            joint_attention_kwargs={},
            return_dict=False,
        )

    def diffusers_step():  # the transformer call(s) of one step of diffusers' denoising loop
        out = p.transformer(**kw)
        if case.glm and state.do_cfg:  # GLM-Image CFG: a second, unconditional pass
            neg = state.cond["neg"]
            drop = torch.ones_like(kw["prior_token_drop"])
            out = p.transformer(**{**kw, "encoder_hidden_states": neg, "prior_token_drop": drop})
        return out

    out = {}
    fns = [("diffusers_eager", diffusers_step), ("engine_eager", engine_step)]
    if compile_:
        fns.append(("engine_compiled", engine_step))
    with torch.inference_mode():
        for name, fn in fns:
            if name == "engine_compiled":
                adapter.transformer = torch.compile(case.pipe.transformer)
            for _ in range(3):
                fn()
            times = [case.timed(fn)[0] for _ in range(iters)]
            out[name] = 1000 * min(times)
            print(f"  {case.name} one step batch 1 {name}: {out[name]:.1f} ms", flush=True)
    adapter.transformer = case.pipe.transformer
    eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", default=None, help="tiny | small | cpu (both) | full | full-flux | full-glm"
    )
    ap.add_argument("--gpu", action="store_true", help="the full-size configs on cuda in bf16")
    ap.add_argument("--model", default=None, help="tiny FLUX folder (default: build one)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time the step with torch.compile")
    ap.add_argument("--smoke", action="store_true", help="full configs with 1 block, 64 px, on CPU")
    ap.add_argument(
        "--step-variants",
        action="store_true",
        help="FLUX.1-dev-size transformer only: one step per speed option (GPU; --smoke on CPU)",
    )
    ap.add_argument("--variants", default=None, help="comma list of --step-variants names")
    ap.add_argument("--budget-s", type=float, default=300, help="--step-variants time budget")
    args = ap.parse_args()
    if args.step_variants:
        only = args.variants.split(",") if args.variants else None
        step_variants(args.smoke, args.budget_s, only)
        return
    config = args.config or ("full" if args.gpu else "cpu")
    gpu = (args.gpu or config.startswith("full")) and not args.smoke
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    full_size = 64 if args.smoke else 1024
    names = {"cpu": ["tiny", "small"], "full": ["full-flux", "full-glm"]}.get(config, [config])
    results = []
    for name in names:
        t0 = time.perf_counter()
        if name == "tiny":
            case = Case(
                name, tiny_flux_pipe(args.model), FluxAdapter, 64, args.steps or 4, device, dtype
            )
        elif name == "small":
            case = Case(
                name,
                flux_pipe("small", device, dtype).to(device),
                FluxAdapter,
                256,
                args.steps or 4,
                device,
                dtype,
            )
        elif name == "full-flux":
            case = Case(
                name,
                flux_pipe("full", device, dtype, args.smoke).to(device),
                FluxAdapter,
                full_size,
                args.steps or 4,
                device,
                dtype,
            )
        elif name == "full-glm":
            case = Case(
                name,
                glm_pipe(device, dtype, args.smoke).to(device),
                GlmImageAdapter,
                full_size,
                args.steps or 4,
                device,
                dtype,
            )
        else:
            raise SystemExit(f"unknown config {name}")
        built = time.perf_counter() - t0
        res = run_case(case, args.repeats, step_time=gpu or args.smoke, compile_=args.compile)
        res["build_s"] = built
        results.append(res)
        del case
        if gpu:
            torch.cuda.empty_cache()
    machine = f"{platform.machine()} {torch.get_num_threads()} threads"
    if gpu:
        machine = torch.cuda.get_device_name()
    print(f"\nmachine: {machine}; torch {torch.__version__}; command: {' '.join(sys.argv)}")
    hdr = (
        f"{'config':<10} {'c1 lat diffusers':>17} {'c1 lat engine':>14} {'c1 x':>6} "
        f"{'c8 img/s diff':>14} {'c8 img/s eng':>13} {'c8 x':>6} {'pixdiff':>8}"
    )
    print(hdr)
    for r in results:
        lat, tp = r["c1_latency_s"], r["c8_images_per_s"]
        print(
            f"{r['config']:<10} {lat['diffusers']:>16.3f}s {lat['engine']:>13.3f}s {r['c1_speedup']:>6.2f} "
            f"{tp['diffusers']:>14.2f} {tp['engine']:>13.2f} {r['c8_speedup']:>6.2f} {r['max_mean_pixel_diff']:>8.3f}"
        )
        if "step_ms" in r:
            print(
                f"{'':<10} one step, batch 1: "
                + ", ".join(f"{k} {v:.1f} ms" for k, v in r["step_ms"].items())
            )
    print(json.dumps({"machine": machine, "torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
