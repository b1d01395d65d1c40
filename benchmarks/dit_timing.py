"""Measurement helpers of bench_dit_gpu.py: the time budget and its notes (`T0`, `NOTES`,
`left_s`, `note`), synced wall-clock timing, a DiT's matmul FLOPs, the top kernels of a call,
the step-variant runner (`run_variants` times each acceleration variant of a transformer on fixed
inputs, via `Call`, against a bf16 eager and a float32 reference), and the end-to-end checks:
host syncs per denoising step (torch's sync debug mode) and SSIM between two images.
"""

from __future__ import annotations

import gc
import json
import time

import torch
from diffusion_models import kernel_times, rel_err, sync, time_ms

from vllm_omni_plugin.diffusion.acceleration import (
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
        if row["graphs"] is not None and not row["graphs"]["captures"]:
            note(f"{label} {name}: CUDA graphs captured nothing: {row['graphs']}")
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


# ---- 4: host syncs, image similarity ------------------------------------------------------
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
