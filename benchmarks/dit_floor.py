"""The hardware floor of each diffusion family's denoising step: the step's matmuls and
attention calls, timed alone on the GPU at the served shape, summed.

    python benchmarks/dit_floor.py --out DIR                 # GPU: all families, ~3 min
    python benchmarks/dit_floor.py --families flux,glm-image --out DIR
    python benchmarks/dit_floor.py --dry-run [--peak H200]   # CPU: the op lists, FLOPs,
                                                             # analytic floor, no timing

Per family (dit_floor_families.py: FLUX.1-dev, Qwen-Image, GLM-Image's DiT, Wan2.2 TI2V-5B
and T2V-A14B), the transformer at its published size runs one forward at the shape its deploy
file serves, under FakeTensorMode, and every `F.linear` and attention call it makes is recorded
(dit_floor_ops.py); both CFG rows where the served config guides (one forward at batch 2, as the
engine runs them).

On the GPU each distinct op is timed alone in bf16 on random tensors: CUDA events around a few
back-to-back calls (enough for ~1 ms, so a tiny GEMM's launch does not dominate), after warm-up,
median of `--iters` samples; back to back, a small op's weight stays in L2 cache, as it would
not in a step, which the one-graph figure below checks. The floor is the sum over the step's
ops of count x median: what the step would cost if every norm, RoPE, GELU, modulation and
residual were free and each matmul ran as fast as cuBLAS / torch's SDPA run it alone. Beside
it: the whole op list in call order captured in one CUDA graph (the method of the FLUX floor in
BENCHMARKS.md's seventh run; weights shared by op shape), and the analytic floor (each op's
FLOPs at the datasheet's bf16 dense peak or its bytes at HBM bandwidth, whichever is slower).
nvidia-smi samples the SM clock and board power while a family is timed. The op list must use
every Linear of the transformer, or the family is not timed; a family that fails is a note in
the results, the others still run.

Writes DIR/dit_floor.json (machine, versions, command, per family: shape, per-op table, sums)
and DIR/dit_floor.md; dit_floor_report.py puts the floors beside the served figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dit_floor_families import FAMILIES, Family  # noqa: E402
from dit_floor_ops import (  # noqa: E402
    PEAKS,
    Op,
    analytic_ms,
    grouped,
    linear_coverage,
    peak_for,
    record_ops,
)

WINDOW_MS = 1.0  # shortest timed window per sample: back-to-back calls of a short op


def enumerate_family(family: Family) -> dict:
    """The family's served shape and its step's ops, recorded on a fake full-size model."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape = family.shape()
    rows = family.cfg_rows(shape)
    # The shape environment lets data-dependent ops (GLM's dropped-prior mask) run fake.
    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        model = family.build()
        kwargs = family.inputs(model, shape, rows)
        rec = record_ops(lambda: model(**kwargs))
        coverage = linear_coverage(model, rec)
        blocks = family.blocks(model)
        block_linear = sum(
            m.weight.numel() for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)
        )
    return {
        "family": family,
        "shape": shape,
        "cfg_rows": rows,
        "ops": rec.ops,
        "coverage": {**coverage, "blocks": len(blocks), "block_linear_elements": block_linear},
        "model": model,
        "weights": rec.weights,
    }


def _op_tensors(op: Op, device: torch.device, dtype: torch.dtype):
    if op.kind == "linear":
        x = torch.randn(op.m, op.k, device=device, dtype=dtype)
        w = torch.randn(op.n, op.k, device=device, dtype=dtype) / op.k**0.5
        b = torch.randn(op.n, device=device, dtype=dtype) if op.bias else None
        return lambda: F.linear(x, w, b)
    q = torch.randn(op.batch, op.heads, op.q_len, op.head_dim, device=device, dtype=dtype)
    k = torch.randn(op.batch, op.heads, op.kv_len, op.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.ones(op.mask_shape, device=device, dtype=torch.bool) if op.mask_shape else None
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _call_ms(fn, reps: int, device: torch.device) -> float:
    """ms per call over `reps` back-to-back calls: CUDA events on the GPU, wall clock on the
    CPU (where the tests check this code on small ops)."""
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def time_op(op: Op, device: torch.device, warmup: int, iters: int) -> dict:
    """Median and min ms of one call of `op` alone (bf16, random tensors)."""
    fn = _op_tensors(op, device, torch.bfloat16)
    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        one = _call_ms(fn, 1, device)
        reps = max(1, min(200, int(WINDOW_MS / max(one, 1e-3))))
        samples = [_call_ms(fn, reps, device) for _ in range(iters)]
    del fn
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "reps": reps}


def time_sequence(ops: list[Op], device: torch.device, iters: int) -> dict:
    """The op list in call order, captured in one CUDA graph (one tensor set per distinct op)."""
    calls = {}
    for op in dict.fromkeys(ops):
        calls[op] = _op_tensors(op, device, torch.bfloat16)

    def step():
        for op in ops:
            calls[op]()

    with torch.inference_mode():
        replay = step if device.type != "cuda" else _graphed(step)
        replay()
        samples = [_call_ms(replay, 1, device) for _ in range(iters)]
    calls.clear()  # free the tensors before the next family
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "iters": iters}


def _graphed(step):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # cuBLAS handles and workspaces before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def op_row(op: Op, count: int, peak) -> dict:
    row = {"op": op.label(), **{k: v for k, v in vars(op).items() if v not in (0, False, ())}}
    row["mask_shape"] = list(op.mask_shape) if op.mask_shape else None
    row.update(count=count, gflop=op.flops / 1e9, mbytes=op.bytes / 1e6)
    if peak is not None:
        row["analytic_ms"] = analytic_ms(op, peak[1])
    return row


def family_record(found: dict, peak, timings: dict | None, sequence: dict | None) -> dict:
    family, shape, ops = found["family"], found["shape"], found["ops"]
    rows = []
    for op, count in grouped(ops):
        row = op_row(op, count, peak)
        if timings is not None:
            row.update(timings[op])
        rows.append(row)

    def total(key: str, kind: str | None = None) -> float | None:
        picked = [r for r in rows if kind is None or r["kind"] == kind]
        if any(key not in r for r in picked):
            return None
        return sum(r["count"] * r[key] for r in picked)

    sums = {
        "tflop": sum(op.flops for op in ops) / 1e12,
        "linear_tflop": sum(op.flops for op in ops if op.kind == "linear") / 1e12,
        "sdpa_tflop": sum(op.flops for op in ops if op.kind == "sdpa") / 1e12,
        "linear_calls": sum(op.kind == "linear" for op in ops),
        "sdpa_calls": sum(op.kind == "sdpa" for op in ops),
        "analytic_ms": total("analytic_ms"),
        "floor_ms": total("median_ms"),
        "floor_min_ms": total("min_ms"),
        "linear_ms": total("median_ms", "linear"),
        "sdpa_ms": total("median_ms", "sdpa"),
        "sequence_graph_ms": None if sequence is None else sequence["median_ms"],
        "sequence_graph_min_ms": None if sequence is None else sequence["min_ms"],
    }
    return {
        "family": family.name,
        "title": family.title,
        "shape": {
            "height": shape.height,
            "width": shape.width,
            "frames": shape.frames,
            "steps": shape.steps,
            "guidance": shape.guidance,
            "source": shape.source,
        },
        "cfg_rows": found["cfg_rows"],
        "step_goal_ms": family.step_goal_ms,
        "coverage": {k: v for k, v in found["coverage"].items() if k != "uncalled"},
        "ops": rows,
        "sums": sums,
    }


class MissedLayers(ValueError):
    """The recorded step leaves out Linear layers of the transformer."""


def check_coverage(found: dict) -> None:
    cov = found["coverage"]
    if cov["uncalled"] or cov["weight_elements_used"] != cov["linear_weight_elements"]:
        raise MissedLayers(
            f"{found['family'].name}: the recorded step misses Linear layers {cov['uncalled']}: "
            "its floor would leave them out"
        )


def versions() -> dict:
    import diffusers

    out = {"torch": torch.__version__, "diffusers": diffusers.__version__}
    if torch.cuda.is_available():
        out.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    return out


def markdown(result: dict) -> str:
    lines = [
        f"Machine: {result['machine']}; {json.dumps(result['versions'])}; "
        f"command: `{result['command']}`; {result['date']}",
        "",
    ]
    for fam in result["families"]:
        s, sh = fam["sums"], fam["shape"]
        frames = f"x{sh['frames']} frames" if sh["frames"] else ""
        lines += [
            f"#### {fam['title']}: {sh['width']}x{sh['height']}{frames}, {fam['cfg_rows']} "
            f"row(s) per step, {s['tflop']:.1f} TFLOP ({s['linear_calls']} GEMMs, "
            f"{s['sdpa_calls']} attention calls)",
            "",
            f"floor (ops alone, summed) {_ms(s['floor_ms'])} ms; in one graph "
            f"{_ms(s['sequence_graph_ms'])} ms; analytic {_ms(s['analytic_ms'])} ms; clock "
            f"{json.dumps(fam.get('clock'))}",
            "",
            "| op | count | GFLOP each | median ms | min ms | TFLOP/s | analytic ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in fam["ops"]:
            med = r.get("median_ms")
            rate = "-" if not med else f"{r['gflop'] / med:.0f}"
            lines.append(
                f"| {r['op']} | {r['count']} | {r['gflop']:.3g} | {_ms(med, '.3f')} "
                f"| {_ms(r.get('min_ms'), '.3f')} | {rate} | {_ms(r.get('analytic_ms'), '.3f')} |"
            )
        lines.append("")
    if result["notes"]:
        lines += ["Notes:", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"


def _ms(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    ap.add_argument("--dry-run", action="store_true", help="enumerate ops, FLOPs; no timing")
    ap.add_argument("--peak", choices=sorted(PEAKS), default=None,
                    help="device datasheet for the analytic floor (default: the GPU's own)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="timed samples per op")
    ap.add_argument("--sequence-iters", type=int, default=5,
                    help="timed replays of the whole op list in one graph (0: skip)")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="seconds for the whole run: a family's graph sequence is skipped when its "
                         "replays would not fit in what is left")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="folder for dit_floor.json / .md")
    args = ap.parse_args(argv)
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    timed = not args.dry_run
    if timed and not torch.cuda.is_available():
        ap.error("timing needs a CUDA device; --dry-run enumerates the ops on the CPU")
    t0 = time.perf_counter()
    device = torch.device("cuda") if timed else torch.device("cpu")
    machine = torch.cuda.get_device_name() if timed else "cpu (dry run)"
    peak = (args.peak, PEAKS[args.peak]) if args.peak else peak_for(machine)
    notes: list[str] = []
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)  # nvidia-smi's samples go there as it runs
    if peak is None:
        notes.append(f"no datasheet peak for {machine!r}: analytic floor left out (--peak)")
    result = {
        "bench": "dit_floor",
        "machine": machine,
        "versions": versions(),
        "command": " ".join(["python", "benchmarks/dit_floor.py", *(argv or sys.argv[1:])]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "timed": timed,
        "peak": None
        if peak is None
        else {
            "device": peak[0],
            "bf16_flops": peak[1][0],
            "hbm_bytes_per_s": peak[1][1],
        },  # fmt: skip
        "settings": {
            "warmup": args.warmup,
            "iters": args.iters,
            "window_ms": WINDOW_MS,
            "sequence_iters": args.sequence_iters,
        },  # fmt: skip
        "families": [],
        "notes": notes,
    }
    for name in names:
        try:
            rec = measure_family(FAMILIES[name], args, device, peak, t0, notes)
        except Exception as exc:  # one family's failure must not cost the others' floors
            if not timed:
                raise
            notes.append(f"{name} FAILED: {type(exc).__name__}: {str(exc)[:300]}")
            print(f"{name} FAILED: {exc!r}", flush=True)
            continue
        result["families"].append(rec)
        s = rec["sums"]
        print(
            f"{name}: {s['tflop']:.1f} TFLOP/step, floor {_ms(s['floor_ms'])} ms, graph "
            f"{_ms(s['sequence_graph_ms'])} ms, analytic {_ms(s['analytic_ms'])} ms "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        save(result, args.out)  # after each family: a run cut short keeps what it measured
    save(result, args.out)
    print(markdown(result))
    return result


def measure_family(family: Family, args, device, peak, t0: float, notes: list[str]) -> dict:
    """The family's record: its ops, and on the GPU their times alone and in one graph."""
    found = enumerate_family(family)
    check_coverage(found)
    timings = sequence = clock = None
    if device.type == "cuda":
        from bench_dit_ab import ClockSampler, window_means

        sampler = ClockSampler(args.out / f"nvidia_smi_{family.name}.csv" if args.out else None)
        start = dt.datetime.now()
        try:
            timings = {
                op: time_op(op, device, args.warmup, args.iters) for op, _ in grouped(found["ops"])
            }
            est_s = sum(timings[op]["median_ms"] for op in found["ops"]) / 1e3
            left_s = args.budget_s - (time.perf_counter() - t0)
            if args.sequence_iters and est_s * (args.sequence_iters + 3) < left_s:
                sequence = time_sequence(found["ops"], device, args.sequence_iters)
            elif args.sequence_iters:
                notes.append(
                    f"{family.name}: graph sequence skipped (~{est_s:.1f} s a replay, "
                    f"{left_s:.0f} s of the budget left)"
                )
        finally:
            clock = window_means(sampler.stop(), [(start, dt.datetime.now())])
    rec = family_record(found, peak, timings, sequence)
    rec["clock"] = clock
    return rec


def save(result: dict, out: Path | None) -> None:
    if out:
        (out / "dit_floor.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "dit_floor.md").write_text(markdown(result))


if __name__ == "__main__":
    main()
