"""LoRA per request: step time and steady throughput with 0, 1 and N distinct adapters in the
batch, on the diffusion engine.

    # CPU smoke test on a tiny checkpoint (seconds):
    .venv/bin/python benchmarks/bench_lora.py --build tiny --size 64 --steps 4 --rank 4 \
        --device cpu --dtype float32
    # H200: FLUX.1-dev size with random bf16 weights (built on the GPU, ~34 GB on disk),
    # 1024x1024, concurrency 8, rank-32 adapters:
    python benchmarks/bench_lora.py --build full --work /data/bench-lora --size 1024 --steps 28

Rows (one JSON line each):
* `baseline`: an engine without a `lora` section (the stage's default accelerations, e.g. the
  fused GELU on CUDA);
* `adapters=0`: an engine with `lora` (its linears wrapped; no request names an adapter);
* `adapters=1`: every request runs the same adapter;
* `adapters=N`: request i runs adapter i mod N (`--adapters`, default 0 1 4): N distinct
  low-rank updates in every forward.
`step_ms`: median wall time of an engine step while all `--concurrency` requests denoise
together (synchronised on CUDA); `images_per_s`: images / wall time of the whole run (admission,
text encoding and decode included: the steady rate of a full batch); `vs_adapters0`: step time
relative to `adapters=0`. Adapters are random (make-tiny-lora's builder: every linear of the
family's declared targets at `--rank`), so they cost what a real adapter of that rank and
coverage costs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
from vllm_omni_plugin.diffusion.lora.tiny import build_tiny_lora


def request(rid: str, seed: int, args, lora) -> GenerationRequest:
    return GenerationRequest(
        rid,
        f"a photo of a cat, variation {seed}",
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        seed=seed,
        lora=lora,
    )


def timed_run(engine: DiffusionEngine, reqs: list[GenerationRequest], cuda: bool):
    """(step times of full-batch steps in ms, images per second of the whole run)."""
    for r in reqs:
        engine.add_request(r)
    full, t_start = [], time.perf_counter()
    while engine.has_unfinished():
        running = len(engine.scheduler.running)
        t0 = time.perf_counter()
        outs = engine.step()
        if cuda:
            torch.cuda.synchronize()
        spent = (time.perf_counter() - t0) * 1e3
        # A step where every request was already running and none finished: pure denoising.
        if running == len(reqs) and not outs:
            full.append(spent)
        for o in outs:
            if o.error:
                raise RuntimeError(f"{o.request_id}: {o.error}")
    total = time.perf_counter() - t_start
    return full, sum(r.n for r in reqs) / total


def engine_for(args, model: str, lora_dir: str | None) -> DiffusionEngine:
    cfg = DiffusionEngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.concurrency,
        min_height=args.size,
        min_width=args.size,
        max_num_inference_steps=max(args.steps, 200),
        lora=None
        if lora_dir is None
        else {"dir": lora_dir, "max_loaded": max(args.adapters + [1]), "max_rank": args.rank},
    )
    return DiffusionEngine(cfg)


def run(args) -> list[dict]:
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-lora-"))
    model = args.model
    if model is None:
        from vllm_omni_plugin.testing.tiny_models import build_tiny_model

        model = str(work / f"flux-{args.build}")
        if not (Path(model) / "model_index.json").is_file():
            build_tiny_model("flux", model, seed=0, size=args.build)
    lora_dir = work / f"loras-r{args.rank}"
    names = [f"lora{i}" for i in range(max(args.adapters + [0]))]
    for i, name in enumerate(names):
        if not (lora_dir / name).is_dir():
            build_tiny_lora(model, lora_dir / name, rank=args.rank, seed=i)
    cuda = args.device.startswith("cuda")
    rows: list[dict] = []
    configs = ([("baseline", None)] if args.baseline else []) + [("lora", str(lora_dir))]
    for label, folder in configs:
        engine = engine_for(args, model, folder)
        warm = [request("warm", 0, args, None)]
        engine.generate(warm)
        counts = [None] if folder is None else args.adapters
        for count in counts:
            lora = (lambda i: None) if not count else (lambda i, c=count: [{"name": names[i % c]}])
            reqs = [
                request(f"{label}-{count}-{i}", i, args, lora(i)) for i in range(args.concurrency)
            ]
            if count:  # adapters made resident before timing (a warm server has them loaded)
                engine.generate(
                    [request(f"load-{count}-{i}", i, args, lora(i)) for i in range(count)]
                )
            steps, rate = timed_run(engine, reqs, cuda)
            rows.append(
                {
                    "row": label if count is None else f"adapters={count}",
                    "rank": None if count is None else args.rank,
                    "concurrency": args.concurrency,
                    "size": args.size,
                    "step_ms": round(statistics.median(steps), 2) if steps else None,
                    "full_steps": len(steps),
                    "images_per_s": round(rate, 4),
                    "device": args.device,
                }
            )
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    zero = next((r["step_ms"] for r in rows if r["row"] == "adapters=0"), None)
    for r in rows:
        if zero and r["step_ms"]:
            r["vs_adapters0"] = round(r["step_ms"] / zero, 3)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a FLUX pipeline folder (default: build one, see --build)")
    ap.add_argument("--build", choices=["tiny", "full"], default="tiny")
    ap.add_argument("--work", help="where built models and adapters go (kept for re-runs)")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=28)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4])
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    return ap


def main() -> None:
    for row in run(parser().parse_args()):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
