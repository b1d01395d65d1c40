"""Attention kernels at the DiTs' served shapes: is there a faster kernel than the one
torch picks, and what would fp8 attention cost in accuracy?

    python benchmarks/bench_attention_gpu.py [--out DIR]     # H200: ~30 s, random inputs
    python benchmarks/bench_attention_gpu.py --tiny          # CPU: checks the code

One self-attention call, head dim 128, bf16, at FLUX.1-dev's 1024x1024 step (1 x 24 heads x
4608 tokens) and GLM-Image's CFG step (2 x 32 x 4097): torch's SDPA as it chooses (cuDNN's
flash kernel on Hopper with torch 2.11), SDPA held to its flash-v2 kernel, FlashAttention-3
(the `fa3_fwd` wheel vLLM-Omni depends on) in bf16 and in fp8 e4m3 with per-head scales.
Per variant: median/min ms (CUDA events), TFLOP/s (4 * b * h * n^2 * d), relative error
against a float32 SDPA of the same inputs. A kernel that is missing or fails is a note.
In the compiled FLUX step, attention was 26 ms of 134 (573 TFLOP/s; BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusion_models import rel_err, time_ms  # noqa: E402

FP8_MAX = 448.0  # largest float8_e4m3fn


def fa3(q, k, v, fp8: bool):
    """FlashAttention-3 on [b, h, n, d] tensors (it takes [b, n, h, d])."""
    from fa3_fwd_interface import flash_attn_func

    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    scales = {}
    if fp8:
        quantized = []
        for name, t in (("q", q), ("k", k), ("v", v)):
            scale = t.abs().amax(dim=(1, 3)).float().clamp(min=1e-8) / FP8_MAX  # [b, h]
            quantized.append((t / scale[:, None, :, None]).to(torch.float8_e4m3fn))
            scales[f"{name}_descale"] = scale
        q, k, v = quantized
    out = flash_attn_func(q, k, v, **scales)
    out = out[0] if isinstance(out, tuple) else out
    return out.transpose(1, 2)


def variants(q, k, v):
    def sdpa_flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)

    return [
        ("sdpa (torch's choice)", lambda: F.scaled_dot_product_attention(q, k, v)),
        ("sdpa flash-v2", sdpa_flash),
        ("fa3 bf16", lambda: fa3(q, k, v, fp8=False)),
        ("fa3 fp8 e4m3 (per-head scales)", lambda: fa3(q, k, v, fp8=True)),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (code check)")
    ap.add_argument("--out", default=None, help="folder for attention.json")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = (
        [("tiny", 1, 2, 64)] if args.tiny else [("FLUX", 1, 24, 4608), ("GLM CFG", 2, 32, 4097)]
    )
    warmup, iters = (1, 2) if args.tiny else (3, 20)
    rows, notes = [], []
    for label, b, h, n in shapes:
        g = torch.Generator("cpu").manual_seed(0)
        q, k, v = (torch.randn(b, h, n, 128, generator=g).to(device, torch.bfloat16) for _ in "qkv")
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        flops = 4 * b * h * n * n * 128
        for name, fn in variants(q, k, v):
            try:
                with torch.inference_mode():
                    err = rel_err(fn().float(), ref)
                    med, best = time_ms(fn, device, warmup, iters)
            except Exception as exc:  # a kernel missing here must not cost the others
                notes.append(f"{label} {name}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            row = dict(shape=label, batch=b, heads=h, tokens=n, variant=name, median_ms=med)
            row.update(min_ms=best, tflops=flops / (med / 1e3) / 1e12, rel_err_vs_fp32=err)
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [
        "| shape | variant | median ms | min ms | TFLOP/s | rel err vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} {r['batch']}x{r['heads']}x{r['tokens']} | {r['variant']} "
            f"| {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['tflops']:.0f} "
            f"| {r['rel_err_vs_fp32']:.1e} |"
        )
    lines += [f"- note: {n}" for n in notes]
    print("\n".join(lines), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "attention.json").write_text(json.dumps({"rows": rows, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
