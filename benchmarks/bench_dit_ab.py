"""Interleaved A/B of the FLUX.1-dev-size step: which lossless option helps, with
the GPU's clock in the picture, and how far the step is from its own GEMMs + attention.

    python benchmarks/bench_dit_ab.py --out DIR      # H200: full size, ~4 minutes
    python benchmarks/bench_dit_ab.py --tiny         # CPU: tiny sizes, checks the code
    python benchmarks/bench_dit_ab.py --qwen-rows --out DIR  # Qwen-Image: batch 8 of mixed
        # prompt lengths, masked vs per-row attention, against each prompt alone (dit_qwen_rows.py;
        # H200/H100: ~5 minutes; add --cfg for true CFG rows, --tiny for the CPU check)

One run of bench_dit_gpu.py times its variants one after the other, so a variant that runs
while the GPU's sustained clock has dropped looks slower (the same cuBLAS kernel differed by 8 %
between variants of one run). Here every variant has its own copy of the transformer, compiled
and captured up front, and the timed calls alternate: round r times each variant for a few
calls, in an order rotated every round. nvidia-smi samples the SM clock and board power in the
background; each variant's rows carry the mean clock and power over its own timed windows.

The "floor" row is the step's own matmuls and nothing else: every block linear at the input
shape it saw in a real step (recorded by forward hooks, the same weights), plus one SDPA call
per block at the step's attention shape, captured in one CUDA graph. No norm, no RoPE, no
GELU, no modulation: what the step would cost if every elementwise pass were free.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dit_qwen_rows  # noqa: E402
from diffusion_models import call_times_ms, flux_pipe, rel_err, sync  # noqa: E402
from dit_sections import flux_inputs, tiny_flux_transformer  # noqa: E402
from dit_timing import dit_flops  # noqa: E402

from vllm_omni_plugin.diffusion.acceleration import (  # noqa: E402
    _repeated_blocks,
    accelerate_transformer,
)


def variants(cuda: bool) -> dict[str, dict]:
    base = {"compile": True, "regional": True, "cuda_graphs": cuda}
    return {
        "compiled + graphs (no fuse_gelu)": base,
        "+ fuse_gelu (the engine's default)": {**base, "fuse_gelu": True},
        "+ fuse_gelu + fuse_qkv": {**base, "fuse_gelu": True, "fuse_qkv": True},
    }


class MatmulFloor:
    """The step's block linears (recorded shapes, real weights) + one SDPA per block."""

    def __init__(self, tr: torch.nn.Module, kw: dict, heads: int, head_dim: int, tokens: int):
        self.calls: list[tuple[torch.Tensor, torch.nn.Linear]] = []
        inputs: dict[tuple, torch.Tensor] = {}
        seen: list[tuple[torch.nn.Linear, tuple]] = []
        blocks = _repeated_blocks(tr)

        def hook(mod, args):
            seen.append((mod, tuple(args[0].shape)))

        handles = [
            lin.register_forward_pre_hook(hook)
            for b in blocks
            for lin in b.modules()
            if isinstance(lin, torch.nn.Linear)
        ]
        try:
            with torch.inference_mode():
                tr(**kw)
        finally:
            for h in handles:
                h.remove()
        p = next(tr.parameters())
        for lin, shape in seen:
            if shape not in inputs:
                inputs[shape] = torch.randn(shape, device=p.device, dtype=p.dtype)
            self.calls.append((inputs[shape], lin))
        self.qkv = torch.randn(3, 1, heads, tokens, head_dim, device=p.device, dtype=p.dtype)
        self.n_attn = len(blocks)

    def __call__(self) -> None:
        for x, lin in self.calls:
            F.linear(x, lin.weight, lin.bias)
        q, k, v = self.qkv
        for _ in range(self.n_attn):
            F.scaled_dot_product_attention(q, k, v)


def graphed(fn, device: torch.device):
    """`fn` captured in a CUDA graph (CUDA) or `fn` itself (CPU)."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        fn()  # warm: cuBLAS handles, workspaces
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph):
        fn()
    return graph.replay


class ClockSampler:
    """nvidia-smi's SM clock and power every 100 ms, in the background (CUDA only)."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.proc = path, None
        if path is not None:
            query = "timestamp,clocks.sm,power.draw,temperature.gpu"
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"]
                + ["-lms", "100"],
                stdout=open(path, "w"),
                stderr=subprocess.DEVNULL,
            )

    def stop(self) -> list[tuple[dt.datetime, float, float, float]]:
        if self.proc is None:
            return []
        self.proc.terminate()
        self.proc.wait()
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                ts, clock, power, temp = (s.strip() for s in line.split(","))
                when = dt.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f")
                rows.append((when, float(clock), float(power), float(temp)))
            except ValueError:
                continue
        return rows


def window_means(samples, windows) -> dict | None:
    inside = [s for s in samples if any(a <= s[0] <= b for a, b in windows)]
    if not inside:
        return None
    return {
        "sm_clock_mhz": statistics.fmean(s[1] for s in inside),
        "power_w": statistics.fmean(s[2] for s in inside),
        "temp_c": statistics.fmean(s[3] for s in inside),
        "samples": len(inside),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (code check)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (8; tiny 2)")
    ap.add_argument("--calls", type=int, default=5, help="timed calls per variant and round")
    ap.add_argument("--out", default=None, help="folder for dit_ab.json and dit_ab.md")
    ap.add_argument(
        "--qwen-rows",
        action="store_true",
        help="Qwen-Image mixed prompt lengths instead (qwen_rows.json and qwen_rows.md)",
    )
    ap.add_argument("--cfg", action="store_true", help="--qwen-rows: with true CFG rows")
    args = ap.parse_args()
    if args.qwen_rows:
        return qwen_rows_main(args)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    cuda = device.type == "cuda"
    rounds = args.rounds or (2 if args.tiny else 8)
    size, text_len = (64, 16) if args.tiny else (1024, 512)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    if args.tiny:
        base = tiny_flux_transformer(device, dtype).eval()
    else:
        base = flux_pipe("full", device, dtype).transformer.eval()
    gc.collect()
    kw = flux_inputs(base, device, dtype, size, text_len)
    cfg = base.config
    heads, head_dim = cfg.num_attention_heads, cfg.attention_head_dim
    tokens = (size // 16) ** 2 + text_len
    flops = dit_flops(cfg.num_layers + cfg.num_single_layers, heads * head_dim, tokens)
    with torch.inference_mode():
        ref = base(**kw)[0]
    print(f"built in {time.perf_counter() - t0:.1f} s; {flops / 1e12:.1f} TFLOP/step", flush=True)

    floor = MatmulFloor(base, kw, heads, head_dim, tokens)  # hooks on the eager model
    # Each variant on its own copy (made before any is changed): compiled and captured now,
    # then all stay resident.
    todo = list(variants(cuda).items())
    copies = [base] + [copy.deepcopy(base) for _ in todo[1:]]
    steps: dict[str, object] = {}
    setup: dict[str, dict] = {}
    for (name, opts), tr in zip(todo, copies, strict=True):
        t = time.perf_counter()
        fn = accelerate_transformer(tr, device, **opts)
        with torch.inference_mode():
            first = time.perf_counter()
            out = fn(**kw)[0]
            fn(**kw)  # captured here where graphed
            sync(device)
        steps[name] = lambda fn=fn: fn(**kw)
        setup[name] = {
            "setup_s": first - t,
            "first_two_calls_s": time.perf_counter() - first,
            "rel_err_vs_bf16_eager": rel_err(out, ref),
            "graphs": dict(fn.stats) if isinstance(getattr(fn, "stats", None), dict) else None,
        }
        print(f"{name}: {json.dumps(setup[name])}", flush=True)
    steps["floor: block GEMMs + SDPA only (graph)"] = graphed(floor, device)
    setup["floor: block GEMMs + SDPA only (graph)"] = {"gemms": len(floor.calls)}

    sampler = ClockSampler(out_dir / "nvidia_smi.csv" if cuda and out_dir else None)
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    round_medians: dict[str, list[float]] = {n: [] for n in names}
    windows: dict[str, list] = {n: [] for n in names}
    with torch.inference_mode():
        for name in names:  # warm every variant once more before the first timed round
            steps[name]()
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                steps[name]()
                sync(device)
                start = dt.datetime.now()
                got = call_times_ms(steps[name], device, args.calls)
                windows[name].append((start, dt.datetime.now()))
                times[name] += got
                round_medians[name].append(statistics.median(got))
            print(f"round {r}: " + ", ".join(f"{n} {round_medians[n][-1]:.1f}" for n in names))
    samples = sampler.stop()

    baseline = names[0]
    rows = []
    for name in names:
        wins = sum(a < b for a, b in zip(round_medians[name], round_medians[baseline], strict=True))
        med = statistics.median(times[name])
        rows.append(
            {
                "variant": name,
                "median_ms": med,
                "min_ms": min(times[name]),
                "tflops": flops / (med / 1e3) / 1e12,
                "round_medians_ms": round_medians[name],
                "rounds_faster_than_first": None if name == baseline else wins,
                "clock": window_means(samples, windows[name]),
                **setup[name],
            }
        )
    result = {
        "machine": torch.cuda.get_device_name() if cuda else "cpu",
        "software": f"torch {torch.__version__}",
        "command": " ".join(sys.argv),
        "tflop_per_step": flops / 1e12,
        "rounds": rounds,
        "calls_per_round": args.calls,
        "rows": rows,
    }
    md = markdown(result)
    print(md)
    print(json.dumps(result))
    if out_dir:
        (out_dir / "dit_ab.json").write_text(json.dumps(result, indent=1, default=str))
        (out_dir / "dit_ab.md").write_text(md)


def software(device: torch.device) -> str:
    import diffusers

    text = f"torch {torch.__version__}, diffusers {diffusers.__version__}"
    if device.type == "cuda":
        text += f", CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}"
    return text


def qwen_rows_main(args) -> None:
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    cuda = device.type == "cuda"
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    sampler = ClockSampler(out_dir / "nvidia_smi_qwen_rows.csv" if cuda and out_dir else None)
    result = {
        "machine": torch.cuda.get_device_name() if cuda else "cpu",
        "software": software(device),
        "command": " ".join(sys.argv),
        **dit_qwen_rows.qwen_rows(args, device, dtype, sampler, window_means),
    }
    result["total_s"] = time.perf_counter() - t0
    md = dit_qwen_rows.markdown(result)
    print(md)
    print(json.dumps(result, default=str))
    if out_dir:
        (out_dir / "qwen_rows.json").write_text(json.dumps(result, indent=1, default=str))
        (out_dir / "qwen_rows.md").write_text(md)


def markdown(result: dict) -> str:
    lines = [
        f"{result['machine']}, {result['software']}; {result['tflop_per_step']:.1f} TFLOP/step; "
        f"{result['rounds']} interleaved rounds x {result['calls_per_round']} calls",
        "",
        "| variant | median ms | min ms | TFLOP/s | rounds faster than the first row | SM MHz | W "
        "| rel. err vs bf16 eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        clock = r["clock"] or {}
        err = r.get("rel_err_vs_bf16_eager")
        lines.append(
            f"| {r['variant']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['tflops']:.0f} | "
            f"{'-' if r['rounds_faster_than_first'] is None else r['rounds_faster_than_first']}"
            f" | {clock.get('sm_clock_mhz', float('nan')):.0f} | "
            f"{clock.get('power_w', float('nan')):.0f} | "
            f"{'-' if err is None else f'{err:.1e}'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
