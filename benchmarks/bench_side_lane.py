"""The side lane (`overlap_encode_decode`): the same stream of requests with prepare and decode
on the engine thread (`off`) and on the side lane (`on`), in alternating rounds.

    # CPU smoke test on a tiny checkpoint (seconds):
    .venv/bin/python benchmarks/bench_side_lane.py --build tiny --size 64 --steps 8 \
        --device cpu --dtype float32 --interval-ms 30
    # One GPU: FLUX.1-dev size with random bf16 weights, 1024x1024, a request every 2 s:
    python benchmarks/bench_side_lane.py --build full --work /data/bench-side-lane \
        --out side_lane.jsonl

Requests arrive open-loop, one every `--interval-ms` (the driver adds those due before each
engine step), `--requests` in all, each `--steps` steps at `--size`. One JSON line per mode and
round, printed and appended to `--out` (after the file's "run" record: machine, versions,
command, settings), so a run cut short keeps the rounds it finished: `wall_s` (first arrival to
last image), `images_per_s`, `latency_s` (mean arrival to image) and `max_stall_ms`: the
longest wait of a running request between two of its denoising steps (host clock, from the
engine's phase log: the stall a newcomer's encoding or another's decode adds; on CUDA the host
side of the steps, so read it beside the wall-clock columns).

    # BENCHMARKS.md's table, from results files (a "run" record, then one "round" record each):
    python benchmarks/bench_side_lane.py --report benchmarks/results/side_lane_*.jsonl \
        --write BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest


def engine_for(args, model: str, overlap: bool) -> DiffusionEngine:
    cfg = DiffusionEngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        min_height=args.size,
        min_width=args.size,
        overlap_encode_decode=overlap,
    )
    return DiffusionEngine(cfg)


def request(rid: str, seed: int, args) -> GenerationRequest:
    return GenerationRequest(
        rid,
        f"a photo of a cat, variation {seed}",
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        seed=seed,
    )


def max_stall_ms(engine: DiffusionEngine, ids: set[str]) -> float:
    """Longest gap between consecutive denoising steps of one running request."""
    last_end: dict[str, float] = {}
    worst = 0.0
    spans = sorted(
        (s for s in engine.phases.spans() if s.phase == "denoise"), key=lambda s: s.start
    )
    for span in spans:
        for rid in span.request_ids:
            if rid in ids and rid in last_end:
                worst = max(worst, span.start - last_end[rid])
            last_end[rid] = span.end
    return worst * 1e3


def timed_run(engine: DiffusionEngine, args, tag: str, cuda: bool) -> dict:
    reqs = [request(f"{tag}-{i}", i, args) for i in range(args.requests)]
    due = [i * args.interval_ms / 1e3 for i in range(len(reqs))]
    done, latencies = 0, []
    t0 = time.perf_counter()
    added = 0
    while done < len(reqs):
        now = time.perf_counter() - t0
        while added < len(reqs) and due[added] <= now:
            engine.add_request(reqs[added])
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[added] - now))
            continue
        for o in engine.step():
            if o.error:
                raise RuntimeError(f"{o.request_id}: {o.error}")
            latencies.append(o.metrics["total_s"])
            done += 1
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {
        "wall_s": round(wall, 3),
        "images_per_s": round(len(reqs) / wall, 3),
        "latency_s": round(statistics.mean(latencies), 3),
        "max_stall_ms": round(max_stall_ms(engine, {r.request_id for r in reqs}), 1),
    }


def run_record(args, model: str, cuda: bool) -> dict:
    """The results file's first line: what ran, where, with which versions and settings."""
    versions = {}
    for package in ("vllm", "torch", "diffusers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {
        "bench": "side_lane",
        "record": "run",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": datetime.date.today().isoformat(),
        "versions": versions,
        "model": model if args.model else f"FLUX, {args.build} size, random weights (built)",
        "command": shlex.join(["bench_side_lane.py", *sys.argv[1:]]),
        "size": args.size,
        "steps": args.steps,
        "requests": args.requests,
        "interval_ms": args.interval_ms,
        "max_batch_size": args.max_batch_size,
        "dtype": args.dtype,
    }


def _append(path: Path | None, record: dict) -> None:
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def run(args) -> list[dict]:
    model = args.model
    if model is None:
        from vllm_omni_plugin.testing.tiny_models import build_tiny_model

        work = Path(args.work or tempfile.mkdtemp(prefix="bench-side-lane-"))
        model = str(work / f"flux-{args.build}")
        if not (Path(model) / "model_index.json").is_file():
            build_tiny_model("flux", model, seed=0, size=args.build)
    cuda = args.device.startswith("cuda")
    _append(args.out, run_record(args, model, cuda))
    rows = []
    # One engine at a time (two full-size FLUX engines do not fit an 80 GB card), started
    # afresh for each round: its compile, capture and first-call costs stay out of the round.
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            engine = engine_for(args, model, mode == "on")
            engine.generate([request(f"warm-{mode}-{r}-{i}", i, args) for i in range(2)])
            row = timed_run(engine, args, f"{mode}-{r}", cuda)
            rows.append(
                {"bench": "side_lane", "record": "round", "mode": mode, "round": r}
                | row
                | {"device": args.device}
            )
            print(json.dumps(rows[-1]), flush=True)
            _append(args.out, rows[-1])
            engine.close()
            del engine
            # An engine is a reference cycle (its scheduler holds its hooks): collect it now, or
            # its weights stay on the card beside the next engine's.
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return rows


BEGIN, END = "<!-- side-lane:begin -->", "<!-- side-lane:end -->"


def _spread(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    mid = round(statistics.median(values), digits)
    if len(values) == 1:
        return f"{mid} (n=1)"
    return f"{mid} ({round(min(values), digits)}-{round(max(values), digits)}, n={len(values)})"


def report(paths: list[Path]) -> str:
    """A table per results file: each mode's rounds (median, min-max), and on over off."""
    parts = []
    for path in paths:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        (run,) = [r for r in records if r.get("record") == "run"]
        rounds = [r for r in records if r.get("record") == "round"]
        by_mode = {m: [r for r in rounds if r["mode"] == m] for m in ("off", "on")}
        parts.append(
            f"{run['model']}, {run['size']}x{run['size']}, {run['steps']} steps, "
            f"{run['requests']} requests one every {run['interval_ms'] / 1000:g} s, "
            f"max_batch_size {run['max_batch_size']}; {run['device']}, "
            + ", ".join(f"{k} {v}" for k, v in run["versions"].items())
            + f" ({path.name}). Command: `{run['command']}`."
        )
        parts.append("")
        parts.append("| figure | off | on | on / off |")
        parts.append("|---|---|---|---|")
        for key, label, digits in (
            ("images_per_s", "images per second", 3),
            ("latency_s", "mean latency, arrival to image (s)", 2),
            ("max_stall_ms", "longest wait between a request's steps (ms)", 1),
        ):
            off = [r[key] for r in by_mode["off"]]
            on = [r[key] for r in by_mode["on"]]
            ratio = (
                f"{statistics.median(on) / statistics.median(off):.2f}"
                if off and on and statistics.median(off)
                else "-"
            )
            parts.append(f"| {label} | {_spread(off, digits)} | {_spread(on, digits)} | {ratio} |")
        if run.get("note"):
            parts.append("")
            parts.append(f"Note: {run['note']}.")
        parts.append("")
    return "\n".join(parts)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a FLUX pipeline folder (default: build one, see --build)")
    ap.add_argument("--build", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--work", help="where a built model goes (kept for re-runs)")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--interval-ms", type=float, default=2000.0)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, help="results file (jsonl) the run and its rounds go to")
    ap.add_argument("--report", type=Path, nargs="+", help="results files: print their table")
    ap.add_argument("--write", type=Path, help="with --report: the markdown file with the markers")
    return ap


def main() -> None:
    args = parser().parse_args()
    if args.report:
        text = report(args.report)
        if args.write:
            from fair_report import write_into

            write_into(args.write, text, BEGIN, END)
        print(text)
        return
    if args.out is not None and args.out.exists():
        raise SystemExit(f"{args.out} exists: a results file holds one run")
    run(args)  # prints a JSON line per mode and round as it ends


if __name__ == "__main__":
    main()
