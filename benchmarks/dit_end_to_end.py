"""Section 4 of bench_dit_gpu.py: end to end, a FLUX.1-dev-size pipeline (a small one with
--tiny) at 28 and 50 steps, diffusers eager, diffusers + regional compile, our engine (and fp8 on
CUDA): warm-up and per-image time, pixel difference vs diffusers eager, pixel difference and SSIM
of fp8 vs our bf16, host syncs per warm engine step.
"""

from __future__ import annotations

import copy
import gc
import json

import torch
from bench_diffusion import pixel_diff
from diffusion_models import flux_pipe
from dit_timing import left_s, note, ssim, syncs_per_step, timed_s

from vllm_omni_plugin.diffusion.acceleration import reset_transformer

# ---- 4: end to end -------------------------------------------------------------------------
OURS = "ours (regional compile + CUDA graphs + fuse_gelu)"


def end_to_end(args, pipe, device, dtype, budget) -> list:
    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
    from vllm_omni_plugin.diffusion.adapters.flux import FluxAdapter

    tiny = args.tiny
    if pipe is None:  # tiny: a small pipeline of the same family
        pipe = flux_pipe("small", device, dtype).to(device)
    size = 64 if tiny else 1024
    steps_list = (2, 3) if tiny else (28, 50)
    prompt = "a photo of a cat"
    rows, images = [], {}

    def diffusers_run(steps):
        return pipe(
            prompt,
            height=size,
            width=size,
            num_inference_steps=steps,
            guidance_scale=3.5,
            generator=torch.Generator("cpu").manual_seed(0),
        ).images[0]

    engine = None

    def ours_run(steps, i=[0]):  # noqa: B006 - a counter for unique request ids
        i[0] += 1
        req = GenerationRequest(
            f"e2e{i[0]}",
            prompt,
            height=size,
            width=size,
            num_inference_steps=steps,
            guidance_scale=3.5,
            seed=0,
        )
        return engine.generate([req])[0].images[0]

    systems = [
        ("diffusers eager", 0 if tiny else 25),
        ("diffusers + regional compile", 30 if tiny else 40),
        (OURS, 30 if tiny else 35),
    ]
    if device.type == "cuda":  # fp8 GEMMs are refused on the CPU
        systems.append(("ours fp8 (regional compile + CUDA graphs)", 40))
    for name, cost in systems:
        if cost > left_s(budget):
            note(f"end to end {name}: skipped, needs ~{cost}s, {left_s(budget):.0f}s left")
            continue
        reset_transformer(pipe.transformer)
        torch._dynamo.reset()
        bf16_transformer = pipe.transformer
        try:
            if name.startswith("ours"):
                # A serving engine changes its transformer for good (fused GELU modules, fp8
                # weights without their bf16 ones): it gets a copy, so the next system still
                # starts from diffusers' bf16 transformer.
                pipe.transformer = copy.deepcopy(bf16_transformer)
                adapter = FluxAdapter(pipe, device, dtype, {})
                cfg = DiffusionEngineConfig(
                    model="flux-dev-size",
                    device=str(device),
                    max_batch_size=1,
                    compile_transformer=True,
                    compile_regional=True,
                    fp8_linear="fp8" in name,
                )
                cfg.dtype = str(dtype).split(".")[-1]
                engine = DiffusionEngine(cfg, adapter=adapter)
                run = ours_run
            else:
                if "compile" in name:
                    pipe.transformer.compile_repeated_blocks()
                run = diffusers_run
            warm_s, _ = timed_s(lambda run=run: run(2), device)  # compile + capture
            row = dict(system=name, warmup_2_steps_s=warm_s)
            for steps in steps_list:
                if left_s(budget) < 5:
                    note(f"end to end {name} {steps} steps: skipped, budget spent")
                    continue
                dt, img = timed_s(lambda run=run, steps=steps: run(steps), device)
                row[f"{steps}_steps_s"] = dt
                images[(name, steps)] = img
            if device.type == "cuda" and name == OURS:
                row["host_syncs_per_step"] = syncs_per_step(run)
            ref = images.get(("diffusers eager", steps_list[0]))
            mine = images.get((name, steps_list[0]))
            if ref is not None and mine is not None:
                row["mean_pixel_diff_vs_diffusers_eager"] = pixel_diff(ref, mine)
            bf16 = images.get((OURS, steps_list[0]))
            if "fp8" in name and bf16 is not None and mine is not None:
                row["mean_pixel_diff_vs_ours_bf16"] = pixel_diff(bf16, mine)
                row["ssim_vs_ours_bf16"] = ssim(bf16, mine)
            rows.append(row)
            print(json.dumps(row), flush=True)
        except Exception as exc:
            note(f"end to end {name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            pipe.transformer = bf16_transformer
            if engine is not None:
                engine.adapter.transformer = pipe.transformer
                engine = None
            reset_transformer(pipe.transformer)
            gc.collect()  # the fp8 copy's memory goes back before the next system
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    return rows
