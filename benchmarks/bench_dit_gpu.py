"""DiT speed on one GPU (issue 16): step variants, GLM-Image CFG step, the served-shape finding,
end-to-end images. One script, one time budget; prints a markdown table and a JSON line.

    python benchmarks/bench_dit_gpu.py --out DIR            # H200: full sizes, ~8 minutes
    python benchmarks/bench_dit_gpu.py --tiny               # CPU: tiny sizes, checks the code

All weights are random and built in-process on the device (no downloads); needs torch,
diffusers, transformers and this package (no vLLM).

Sections, in order (each variant has a cost estimate and is skipped, with a note, when the
budget left is smaller):
  1. FLUX.1-dev-size transformer, one forward at 1024x1024 (4096 image + 512 text tokens),
     batch 1: diffusers eager, ours eager, ours eager + CUDA graphs, ours regional compile,
     ours compile + CUDA graphs, ours fp8 (compile + graphs); median/min (CUDA events), TFLOP/s,
     first-call and capture time, relative error vs the bf16 eager output and vs a float32
     forward of the same weights and inputs; the compiled step's top kernels (fusion check).
  2. GLM-Image DiT at its real size (testing/full_glm_image.py: 30 layers, 32 x 128) with CFG
     at 1024x1024: diffusers (two passes, as its pipeline) vs ours (both rows in one forward)
     eager, compiled, compiled + graphs.
  3. The served-shape sequence of issue 10's finding: the first requests' transformer calls as
     the GLM adapter makes them (CFG rows of equal glyph length share a forward; a quoted text
     makes the cond row longer, so cond and uncond run apart at batch 1), under the old policy
     (regional compile, torch's automatic dynamic shapes, diffusers' forward with its host
     syncs) and ours; per call: time (compiles included), graphs compiled so far.
  4. End to end, FLUX.1-dev-size pipeline (small random text encoders, FLUX-size VAE) at
     1024x1024, 28 and 50 steps: diffusers eager, diffusers + regional compile, our engine
     (regional compile + CUDA graphs), text encoding + denoising + VAE decode; and how often a
     warm engine step makes the host wait for the GPU (torch's sync debug mode; goal 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_diffusion import flux_pipe, pixel_diff, rel_err  # noqa: E402
from diffusion_models import kernel_times, sync, time_ms  # noqa: E402

from vllm_omni_plugin.diffusion.acceleration import (  # noqa: E402
    accelerate_transformer,
    reset_transformer,
)

T0 = time.perf_counter()
NOTES: list[str] = []


def left_s(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def note(msg: str) -> None:
    NOTES.append(msg)
    print(f"  note: {msg}", flush=True)


def timed_s(fn, device: torch.device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def dit_flops(layers: int, inner: int, tokens: int, batch: int = 1) -> float:
    """Matmul FLOPs of a DiT forward: per layer and token 12 inner^2 weights (QKV 3, out 1,
    MLP 8), 2 FLOPs each, plus attention 4 N inner per token. Holds for FLUX's double and
    single blocks and GLM-Image's blocks alike."""
    return batch * layers * (24 * inner * inner * tokens + 4 * tokens * tokens * inner)


def top_kernels(fn, device: torch.device, n: int = 12) -> list[tuple[str, float]]:
    """Device time by kernel over one call (the names show what inductor fused)."""
    rows = [(key[:90], ms) for key, ms in kernel_times(fn, device)]
    rows.sort(key=lambda r: -r[1])
    for key, ms in rows[:n]:
        print(f"    {ms:8.2f} ms  {key}", flush=True)
    return rows[:n]


def graph_stats(fn) -> dict | None:
    stats = getattr(fn, "stats", None)
    return dict(stats) if isinstance(stats, dict) else None


# ---- models -------------------------------------------------------------------------------
def tiny_flux_transformer(device, dtype):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).to(device, dtype)


def flux_inputs(tr, device, dtype, size: int, text_len: int) -> dict:
    """What diffusers' FLUX loop passes its transformer at one step (random values)."""
    from diffusers import FluxPipeline

    g = torch.Generator("cpu").manual_seed(0)
    h = size // 16
    cfg = tr.config

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return dict(
        hidden_states=rnd(1, h * h, cfg.in_channels),
        timestep=torch.full([1], 0.7, device=device, dtype=dtype),
        guidance=torch.full([1], 3.5, device=device, dtype=torch.float32),
        pooled_projections=rnd(1, cfg.pooled_projection_dim),
        encoder_hidden_states=rnd(1, text_len, cfg.joint_attention_dim),
        txt_ids=torch.zeros(text_len, 3, device=device, dtype=dtype),
        img_ids=FluxPipeline._prepare_latent_image_ids(1, h, h, device, dtype),
        joint_attention_kwargs={},
        return_dict=False,
    )


def glm_transformer(device, dtype, tiny: bool):
    from diffusers import GlmImageTransformer2DModel

    from vllm_omni_plugin.testing.full_glm_image import DIT

    cfg = dict(DIT)
    if tiny:
        cfg.update(num_layers=2, attention_head_dim=16, num_attention_heads=2, text_embed_dim=32)
        cfg.update(prior_vq_quantizer_codebook_size=64)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype directly (no float32 copy)
    try:
        torch.manual_seed(0)
        with torch.device(device):
            tr = GlmImageTransformer2DModel(**cfg)
    finally:
        torch.set_default_dtype(prev)
    return tr.eval()


def glm_inputs(tr, device, dtype, size: int, rows: list[tuple[int, bool]], seed: int = 0) -> dict:
    """One GLM forward over `rows` = [(glyph length, prior dropped?)], equal lengths."""
    g = torch.Generator("cpu").manual_seed(seed)
    cfg = tr.config
    b, lat = len(rows), size // 8
    tokens = (lat // cfg.patch_size) ** 2
    lens = {n for n, _ in rows}
    assert len(lens) == 1, "rows of one forward share a glyph length"
    n = lens.pop()
    return dict(
        hidden_states=torch.randn(b, cfg.in_channels, lat, lat, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(b, n, cfg.text_embed_dim, generator=g).to(device, dtype),
        prior_token_id=torch.randint(
            0, cfg.prior_vq_quantizer_codebook_size, (b, tokens), generator=g
        ).to(device),
        prior_token_drop=torch.tensor([[d] * tokens for _, d in rows], device=device),
        timestep=torch.full([b], 700.0, device=device, dtype=dtype),
        target_size=torch.tensor([[size, size]] * b, device=device, dtype=dtype),
        crop_coords=torch.zeros(b, 2, device=device, dtype=dtype),
        attention_kwargs=None,
        return_dict=False,
    )


# ---- 1 + 2: step variants ------------------------------------------------------------------
def run_variants(label, tr, device, variants, call_ref, flops, ref, ref32, budget, warmup, iters):
    """Time each (name, options, est. cost s, profile?) variant of `tr` on fixed inputs."""
    rows = []
    for name, opts, cost, prof in variants:
        if opts is None:
            note(f"{label} {name}: {cost}")
            continue
        if cost > left_s(budget):
            note(f"{label} {name}: skipped, needs ~{cost:.0f}s, {left_s(budget):.0f}s left")
            continue
        try:
            reset_transformer(tr)
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            setup_s = 0.0
            if opts == "diffusers":
                fn = None
                step = call_ref
            else:
                setup_s, fn = timed_s(
                    lambda opts=opts: accelerate_transformer(tr, device, **opts), device
                )
                step = call_ref.with_fn(fn)
            with torch.inference_mode():
                first_s, _ = timed_s(step, device)  # compiles where compiled
                second_s, _ = timed_s(step, device)  # captures where graphed
                med, best = time_ms(step, device, warmup, iters)
                out = step()[0]
                kernels = top_kernels(step, device) if prof else None
            row = dict(
                variant=name,
                options=opts if isinstance(opts, dict) else {},
                median_ms=med,
                min_ms=best,
                tflops=flops / (med / 1e3) / 1e12,
                setup_s=setup_s,
                first_call_s=first_s,
                second_call_s=second_s,
                rel_err_vs_bf16_eager=rel_err(out, ref) if ref is not None else 0.0,
                rel_err_vs_fp32=rel_err(out, ref32) if ref32 is not None else None,
                peak_gib=(torch.cuda.max_memory_allocated() / 2**30)
                if device.type == "cuda"
                else None,
                graphs=graph_stats(fn),
                top_kernels=kernels,
            )
        except Exception as exc:  # one failing variant must not cost the other measurements
            note(f"{label} {name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        finally:
            reset_transformer(tr)
            fn = step = None  # drop the graphs (their pool) before the next variant
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
    torch._dynamo.reset()
    return rows


class Call:
    """A transformer call on fixed inputs; `with_fn` swaps what is called."""

    def __init__(self, fn, kwargs_list):
        self.fn, self.kwargs_list = fn, kwargs_list

    def with_fn(self, fn) -> Call:
        return Call(fn, self.kwargs_list)

    def __call__(self):
        outs = [self.fn(**kw)[0] for kw in self.kwargs_list]
        return (torch.cat(outs) if len(outs) > 1 else outs[0],)


def float32_reference(tr, kwargs_list, dtype) -> torch.Tensor:
    """The same forward in float32 (weights are bf16-representable, so converting is exact)."""

    def up(v):
        return v.float() if torch.is_tensor(v) and v.is_floating_point() else v

    with torch.inference_mode():
        tr.float()
        try:
            outs = [tr(**{k: up(v) for k, v in kw.items()})[0] for kw in kwargs_list]
        finally:
            tr.to(dtype)
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def compiled_opts(**extra) -> dict:
    return {"compile": True, "regional": True, **extra}


def flux_section(args, device, dtype, budget) -> tuple[list, dict, object]:
    tiny = args.tiny
    size, text_len = (64, 16) if tiny else (1024, 512)
    t = time.perf_counter()
    if tiny:
        pipe = None
        tr = tiny_flux_transformer(device, dtype)
    else:
        pipe = flux_pipe("full", device, dtype).to(device)
        tr = pipe.transformer
    tr.eval()
    kw = flux_inputs(tr, device, dtype, size, text_len)
    cfg = tr.config
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    flops = dit_flops(cfg.num_layers + cfg.num_single_layers, inner, (size // 16) ** 2 + text_len)
    call = Call(tr, [kw])
    with torch.inference_mode():
        ref = call()[0]
    ref32 = float32_reference(tr, [kw], dtype) if dtype != torch.float32 else ref
    base = rel_err(ref, ref32)
    info = dict(
        size=size,
        text_tokens=text_len,
        tflop_per_step=flops / 1e12,
        build_s=time.perf_counter() - t,
        bf16_eager_vs_fp32=base,
    )
    print(f"FLUX: {json.dumps(info)}", flush=True)
    cuda = device.type == "cuda"
    no_gpu = "skipped: CUDA only"
    fp8_why = None
    if cuda:
        from vllm_omni_plugin.diffusion.fp8 import fp8_supported

        fp8_why = fp8_supported(device)
    variants = [
        ("diffusers eager", "diffusers", 10, False),
        ("ours eager", {"cuda_graphs": False}, 10, False),
        (
            "ours eager + CUDA graphs",
            {"cuda_graphs": True} if cuda else None,
            15 if cuda else no_gpu,
            False,
        ),
        ("ours compiled", compiled_opts(cuda_graphs=False), 50, True),
        (
            "ours compiled + CUDA graphs",
            compiled_opts(cuda_graphs=True) if cuda else None,
            30 if cuda else no_gpu,
            True,
        ),
        (
            "ours fp8 (compiled + graphs)",
            compiled_opts(cuda_graphs=True, fp8=True) if cuda and fp8_why is None else None,
            60 if cuda and fp8_why is None else f"skipped: {fp8_why or 'CUDA only'}",
            False,
        ),
    ]
    # Run after every other section, if the budget still allows (informative, not acceptance).
    extras = [
        (
            "ours compiled dynamic=True + graphs",
            compiled_opts(cuda_graphs=cuda, dynamic=True),
            45,
            False,
        ),
        (
            "ours max-autotune (GEMM epilogue fusion) + graphs",
            compiled_opts(cuda_graphs=cuda, mode="max-autotune-no-cudagraphs"),
            240 if cuda else 120,
            True,
        ),
    ]
    if args.only_variants:
        keep = set(args.only_variants.split(","))
        variants = [v for v in variants + extras if v[0] in keep]
        extras = []
    warmup, iters = (1, 2) if tiny else (3, 10)
    rows = run_variants(
        "FLUX", tr, device, variants, call, flops, ref, ref32, budget, warmup, iters
    )

    def run_extras() -> list:
        return run_variants(
            "FLUX", tr, device, extras, call, flops, ref, ref32, budget, warmup, iters
        )

    return rows, info, pipe, run_extras


def glm_section(args, device, dtype, budget) -> tuple[list, dict, object]:
    tiny = args.tiny
    size = 64 if tiny else 1024
    t = time.perf_counter()
    tr = glm_transformer(device, dtype, tiny)
    cfg = tr.config
    # A prompt without quoted text: its glyph input and CFG's empty one are both 1 token, so
    # our adapter runs both rows in one forward (diffusers: two passes, as its pipeline does).
    glyph = 1
    cond = glm_inputs(tr, device, dtype, size, [(glyph, False)], seed=0)
    uncond = {
        **cond,
        "prior_token_drop": torch.ones_like(cond["prior_token_drop"]),
    }
    both = glm_inputs(tr, device, dtype, size, [(glyph, False), (glyph, True)], seed=0)
    both.update(  # the same rows as cond + uncond, so the outputs compare
        hidden_states=torch.cat([cond["hidden_states"]] * 2),
        encoder_hidden_states=torch.cat([cond["encoder_hidden_states"]] * 2),
        prior_token_id=torch.cat([cond["prior_token_id"]] * 2),
    )
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    tokens = (size // 8 // cfg.patch_size) ** 2 + glyph
    flops = dit_flops(cfg.num_layers, inner, tokens, batch=2)
    diffusers_call = Call(tr, [cond, uncond])
    ours_call = Call(tr, [both])
    with torch.inference_mode():
        ref = diffusers_call()[0]
    ref32 = float32_reference(tr, [cond, uncond], dtype) if dtype != torch.float32 else ref
    info = dict(
        size=size,
        layers=cfg.num_layers,
        inner=inner,
        tokens_per_row=tokens,
        tflop_per_cfg_step=flops / 1e12,
        build_s=time.perf_counter() - t,
        bf16_eager_vs_fp32=rel_err(ref, ref32),
    )
    print(f"GLM: {json.dumps(info)}", flush=True)
    cuda = device.type == "cuda"

    class Diffusers(Call):  # run_variants swaps the callee; diffusers' step stays two passes
        def with_fn(self, fn):
            return ours_call.with_fn(fn)

    variants = [
        ("diffusers eager (cond + uncond passes)", "diffusers", 10, False),
        ("ours eager (one forward, batch 2)", {"cuda_graphs": False}, 10, False),
        # (compiled without graphs: in the served sequence below; on CUDA the compile of GLM's
        # four shape classes happens in set-up)
        (
            "ours compiled + CUDA graphs",
            compiled_opts(cuda_graphs=cuda),
            75,
            True,
        ),
    ]
    warmup, iters = (1, 2) if tiny else (3, 10)
    rows = run_variants(
        "GLM",
        tr,
        device,
        variants,
        Diffusers(tr, [cond, uncond]),
        flops,
        ref,
        ref32,
        budget,
        warmup,
        iters,
    )
    return rows, info, tr


# ---- 3: the served-shape sequence --------------------------------------------------------------
def served_sequence(args, tr, device, dtype, budget) -> list:
    """Issue 10's first requests, call by call: warm-up (no quoted text: both CFG rows of glyph
    length 1 share one forward), then two prompts with quoted text (cond row longer: two
    forwards at batch 1 per step). Old policy vs ours, 2 steps per request."""
    size = 64 if args.tiny else 1024
    requests = [
        ("warm-up, no quoted text", 1),
        ('"OPEN" (5 glyph tokens)', 5),
        ("9 glyph tokens", 9),
    ]
    out = []
    for policy in ("old: torch automatic dynamic, host syncs", "ours"):
        cost = 30 if args.tiny else (90 if policy.startswith("old") else 60)
        if cost > left_s(budget):
            note(f"served sequence, {policy}: skipped, needs ~{cost}s, {left_s(budget):.0f}s left")
            continue
        reset_transformer(tr)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        if policy.startswith("old"):
            for block in tr.transformer_blocks:
                block.compile()  # what the served stage did (compile_regional, no options)
            fn = tr
            setup_s = 0.0
        else:
            setup_s, fn = timed_s(
                lambda: accelerate_transformer(
                    tr, device, compile=True, regional=True, cuda_graphs=False
                ),
                device,
            )
        out.append(
            dict(
                policy=policy,
                request="start-up (ours: warm-up compiles)",
                step=0,
                batch=0,
                glyph_len=0,
                call_s=setup_s,
                graphs_compiled=int(counters["stats"]["unique_graphs"]),
            )
        )
        try:
            with torch.inference_mode():
                for label, glyph in requests:
                    if glyph == 1:
                        calls = [[(1, False), (1, True)]]
                    else:
                        calls = [[(glyph, False)], [(1, True)]]
                    kws = [glm_inputs(tr, device, dtype, size, rows) for rows in calls]
                    for step in range(2):
                        for kw in kws:
                            dt, _ = timed_s(lambda kw=kw, fn=fn: fn(**kw), device)
                            row = dict(
                                policy=policy,
                                request=label,
                                step=step,
                                batch=kw["hidden_states"].shape[0],
                                glyph_len=kw["encoder_hidden_states"].shape[1],
                                call_s=dt,
                                graphs_compiled=int(counters["stats"]["unique_graphs"]),
                            )
                            out.append(row)
                            print(json.dumps(row), flush=True)
        except Exception as exc:
            note(f"served sequence {policy} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            reset_transformer(tr)
            torch._dynamo.reset()
    return out


# ---- 4: end to end -------------------------------------------------------------------------
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
        ("ours (regional compile + CUDA graphs)", 30 if tiny else 35),
    ]
    if device.type == "cuda":  # fp8 GEMMs are refused on the CPU
        systems.append(("ours fp8 (regional compile + CUDA graphs)", 40))
    for name, cost in systems:
        if cost > left_s(budget):
            note(f"end to end {name}: skipped, needs ~{cost}s, {left_s(budget):.0f}s left")
            continue
        reset_transformer(pipe.transformer)
        torch._dynamo.reset()
        try:
            if name.startswith("ours"):
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
            if device.type == "cuda" and name == "ours (regional compile + CUDA graphs)":
                row["host_syncs_per_step"] = syncs_per_step(run)
            ref = images.get(("diffusers eager", steps_list[0]))
            mine = images.get((name, steps_list[0]))
            if ref is not None and mine is not None:
                row["mean_pixel_diff_vs_diffusers_eager"] = pixel_diff(ref, mine)
            bf16 = images.get(("ours (regional compile + CUDA graphs)", steps_list[0]))
            if "fp8" in name and bf16 is not None and mine is not None:
                row["mean_pixel_diff_vs_ours_bf16"] = pixel_diff(bf16, mine)
                row["ssim_vs_ours_bf16"] = ssim(bf16, mine)
            rows.append(row)
            print(json.dumps(row), flush=True)
        except Exception as exc:
            note(f"end to end {name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            if engine is not None:
                engine.adapter.transformer = pipe.transformer
            reset_transformer(pipe.transformer)
            torch._dynamo.reset()
    return rows


def host_syncs(fn) -> int:
    """How many times `fn` made the host wait for the GPU (torch's sync debug mode warns once
    per synchronising call: .item(), a blocking upload, nonzero, ...)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def syncs_per_step(run) -> float:
    """Host syncs per denoising step of a warm engine: what 8 steps make beyond 4, over 4
    (a request's own syncs, at admission and decode, cancel out)."""
    return (host_syncs(lambda: run(8)) - host_syncs(lambda: run(4))) / 4


def ssim(a, b) -> float | None:
    """Structural similarity of two RGB images (scikit-image's; None where it is not installed)."""
    try:
        from skimage.metrics import structural_similarity
    except ImportError:
        return None
    import numpy as np

    return float(structural_similarity(np.asarray(a), np.asarray(b), channel_axis=2))


# ---- report --------------------------------------------------------------------------------
def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    lines = [
        f"Machine: {result['machine']}; {result['software']}; command: `{result['command']}`",
        "",
    ]
    for key, title in (("flux", "FLUX.1-dev-size step"), ("glm", "GLM-Image DiT step, CFG")):
        sec = result.get(key)
        if not sec:
            continue
        info = sec["info"]
        lines += [
            f"{title}, {info['size']}x{info['size']}: "
            + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()
            ),
            "",
            "| variant | median ms | min ms | TFLOP/s | set-up s | first call s | 2nd call s "
            "| rel err vs bf16 eager | vs fp32 | peak GiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sec["rows"]:
            lines.append(
                f"| {r['variant']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['tflops']:.0f} "
                f"| {r['setup_s']:.1f} | {r['first_call_s']:.1f} | {r['second_call_s']:.2f} "
                f"| {r['rel_err_vs_bf16_eager']:.1e} | {fmt(r['rel_err_vs_fp32'], '.1e')} "
                f"| {fmt(r['peak_gib'], '.1f')} |"
            )
        lines.append("")
    if result.get("served_sequence"):
        lines += [
            "Served-shape sequence (GLM DiT, regional compile), per call:",
            "",
            "| policy | request | step | batch | glyph len | call s | graphs compiled |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["served_sequence"]:
            lines.append(
                f"| {r['policy']} | {r['request']} | {r['step']} | {r['batch']} | {r['glyph_len']} "
                f"| {r['call_s']:.3f} | {r['graphs_compiled']} |"
            )
        lines.append("")
    if result.get("end_to_end"):
        lines += [
            "End to end, FLUX.1-dev size:",
            "",
            "| system | warm-up (2 steps) s | per image s | pixel diff vs diffusers "
            "| pixel diff / SSIM vs ours bf16 | host syncs per step |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["end_to_end"]:
            per = ", ".join(
                f"{k.split('_')[0]} steps {v:.2f}"
                for k, v in r.items()
                if k.endswith("steps_s") and not k.startswith("warmup")
            )
            lines.append(
                f"| {r['system']} | {r['warmup_2_steps_s']:.1f} | {per} "
                f"| {fmt(r.get('mean_pixel_diff_vs_diffusers_eager'), '.2f')} "
                f"| {fmt(r.get('mean_pixel_diff_vs_ours_bf16'), '.2f')} / "
                f"{fmt(r.get('ssim_vs_ours_bf16'), '.4f')} "
                f"| {fmt(r.get('host_syncs_per_step'), '.2f')} |"
            )
        lines.append("")
    if result["notes"]:
        lines += ["Notes:", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="tiny models on the CPU (code check)")
    ap.add_argument("--budget-s", type=float, default=460.0, help="total seconds (default 460)")
    ap.add_argument("--sections", default="flux,glm,served,e2e")
    ap.add_argument("--only-variants", default=None, help="FLUX variant names, comma-separated")
    ap.add_argument("--out", default=None, help="folder for dit_gpu.json and dit_gpu.md")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    sections = set(args.sections.split(","))
    budget = args.budget_s
    machine = torch.cuda.get_device_name() if device.type == "cuda" else platform.machine()
    import diffusers

    software = f"torch {torch.__version__}, diffusers {diffusers.__version__}"
    if device.type == "cuda":
        software += f", CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    result: dict = {"machine": machine, "software": software, "command": " ".join(sys.argv)}
    pipe = None
    run_extras = None
    if "flux" in sections:
        rows, info, pipe, run_extras = flux_section(args, device, dtype, budget)
        result["flux"] = {"info": info, "rows": rows}
    glm_tr = None
    if "glm" in sections and left_s(budget) > 30:
        rows, info, glm_tr = glm_section(args, device, dtype, budget)
        result["glm"] = {"info": info, "rows": rows}
    if "served" in sections:
        if glm_tr is None:
            glm_tr = glm_transformer(device, dtype, args.tiny)
        result["served_sequence"] = served_sequence(args, glm_tr, device, dtype, budget)
    del glm_tr
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if "e2e" in sections:
        if pipe is None and not args.tiny:
            pipe = flux_pipe("full", device, dtype).to(device)
        result["end_to_end"] = end_to_end(args, pipe, device, dtype, budget)
    if run_extras is not None:
        result["flux"]["rows"] += run_extras()
    result["notes"] = NOTES
    result["total_s"] = time.perf_counter() - T0
    md = markdown(result)
    print("\n" + md, flush=True)
    print(json.dumps(result, default=str), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dit_gpu.json").write_text(json.dumps(result, indent=1, default=str))
        (out / "dit_gpu.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
