"""Side by side on one GPU, the same weights and requests: vllm-omni-plugin, vLLM-Omni 0.26 as it
ships and as tuned (benchmarks/incumbent.py says what changes), and diffusers, for GLM-Image or
Qwen-Image. Each system runs in every round, the order rotated per round (alternating), from a
fresh start with one full-size warm-up; each run appends one JSON line to OUT/results.jsonl.

    python benchmarks/bench_fair.py run --family qwen-image --model DIR --out OUT \
        --systems ours,omni,omni-tuned,diffusers --rounds 3 --requests 32 --concurrency 8
    python benchmarks/bench_fair.py deploy --family glm-image --out OUT   # the incumbent's files
    python benchmarks/fair_report.py OUT/results.jsonl                    # the tables

A served run: `--singles` requests one at a time (latency at concurrency 1, each response's own
stage split), then `--requests` through a closed loop at `--concurrency` (throughput, p50/p99
latency), then, with `--rate`, the same number at Poisson arrivals of that rate (open loop).
diffusers runs in its own process, one request at a time (`--singles` + warm-up): its row is
labelled so. Memory: the device's used memory before the system starts (baseline) and its peak
while it runs (NVML, every 0.2 s), and what its configuration reserves. `--round-offset` lets
rounds continue in a later call or lease (the results file then holds both).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_glm import PROMPTS, PeakMemory, Server, _keep_log_lines, _versions  # noqa: E402
from incumbent import (  # noqa: E402
    installed_stage_fields,
    qwen_image_argv,
    reserved_share,
    shipped_glm_deploy,
    tuned_glm_deploy,
    validate_deploy,
    write_deploys,
)
from load_gen import closed_loop, open_loop, split_from_response  # noqa: E402

SYSTEMS = ("ours", "omni", "omni-tuned", "diffusers")
FAMILIES = {
    # family: our one-GPU stage config, request extras, diffusers pipeline class
    "glm-image": ("glm_image_1gpu", {"guidance_scale": 1.5}, "GlmImagePipeline"),
    "qwen-image": ("qwen_image", {}, "QwenImagePipeline"),
}


# ---- memory ----------------------------------------------------------------------------------
def used_gib() -> float | None:
    """The device's used memory now (all processes), GiB; None without an NVIDIA device."""
    try:
        import pynvml

        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None
    return round(info.used / 2**30, 1)


def total_gib() -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:
        return None
    return round(info.total / 2**30, 1)


def _ours_config(args) -> dict:
    """Our stage config as resolved (with --stage-overrides), stages as flat dicts."""
    from vllm_omni_plugin.config.resolve import load_deploy_config

    cfg = load_deploy_config(args.stage_config, stage_overrides=args.stage_overrides)
    return {"stages": [s.flat_dict() for s in cfg.stages]}


def _reserved(shares: dict[str, float | None], extra: dict | None = None) -> dict:
    """Configured shares and, on a GPU, the GiB they come to."""
    total = total_gib()
    out: dict = {"shares": shares}
    if total is not None and all(v is not None for v in shares.values()):
        out["gib"] = round(sum(shares.values()) * total, 1)
    return out | (extra or {})


# ---- the systems -----------------------------------------------------------------------------
def omni_env(args) -> dict[str, str]:
    """vLLM-Omni with its own general plugin only; ours is on its path for our grid logits
    processor class (GLM-Image, random weights: see incumbent.shipped_glm_deploy)."""
    return {
        "PYTHONPATH": os.pathsep.join(
            x for x in (args.omni_path, os.environ.get("PYTHONPATH")) if x
        ),
        "VLLM_PLUGINS": "vllm_omni_register_models",
    }


def incumbent_deploys(args) -> dict:
    """GLM-Image: write the shipped and tuned deploy files (validated); Qwen-Image: the argv."""
    if args.family == "qwen-image":
        shipped, _ = qwen_image_argv(str(args.model), False, args.concurrency)
        tuned, changes = qwen_image_argv(str(args.model), True, args.concurrency)
        return {
            "shipped_argv": shipped,
            "tuned_argv": tuned,
            "changes": [c.__dict__ for c in changes],
        }
    import yaml

    from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR

    src = Path(args.omni_path) / "vllm_omni" / "deploy" / "glm_image.yaml"
    shipped, base_changes = shipped_glm_deploy(
        yaml.safe_load(src.read_text()), args.size, LOGITS_PROCESSOR
    )
    tuned, changes = tuned_glm_deploy(shipped, _ours_config(args))
    fields = installed_stage_fields(args.omni_path)
    for name, cfg in (("shipped", shipped), ("tuned", tuned)):
        problems = validate_deploy(cfg, fields)
        if problems:
            raise ValueError(f"{name} deploy invalid: {problems}")
    written = write_deploys(args.out, shipped, tuned, changes)
    written["one_gpu_changes"] = [c.__dict__ for c in base_changes]
    written["validated_against"] = "installed vLLM-Omni" if fields else "KNOWN_STAGE_FIELDS"
    written["reserved"] = {"shipped": reserved_share(shipped), "tuned": reserved_share(tuned)}
    return written


def server_argv(args, system: str, deploys: dict) -> tuple[list[str], dict[str, str], dict]:
    """argv, extra env, and the configured reservation of a served system."""
    if system == "ours":
        argv = [str(args.model), "--stage-config", args.stage_config]
        if args.stage_overrides:
            argv += ["--stage-overrides", args.stage_overrides]
        stages = _ours_config(args)["stages"]
        shares = {f"stage_{s['stage_id']}": s.get("gpu_memory_utilization") for s in stages}
        kv = {
            f"stage_{s['stage_id']}_kv_cache_bytes": s["kv_cache_memory_bytes"]
            for s in stages
            if s.get("kv_cache_memory_bytes")
        }
        return argv, {}, _reserved(shares, kv)
    tuned = system == "omni-tuned"
    if args.family == "qwen-image":
        argv = list(deploys["tuned_argv" if tuned else "shipped_argv"])
        # Its diffusion stage sets no share; it takes what the model and activations use.
        return argv, omni_env(args), {"shares": {"stage_0": None}, "note": "no share set"}
    deploy = deploys["tuned" if tuned else "shipped"]
    argv = [str(args.model), "--omni", "--deploy-config", deploy]
    shares = deploys["reserved"]["tuned" if tuned else "shipped"]
    return argv, omni_env(args), _reserved(shares)


async def _send(client, args, i: int, extra: dict, images: Path | None, tag: str) -> dict:
    t0 = time.perf_counter()
    raw = await client.images.with_raw_response.generate(
        model=str(args.model),
        prompt=PROMPTS[i % len(PROMPTS)],
        size=f"{args.size}x{args.size}",
        n=1,
        response_format="b64_json",
        extra_body={"seed": 1000 + i, "num_inference_steps": args.steps, **extra},
    )
    took = time.perf_counter() - t0
    body = raw.http_response.json()
    b64 = body["data"][0]["b64_json"]
    if not b64:
        raise RuntimeError("no image in the response")
    if images is not None:
        images.mkdir(parents=True, exist_ok=True)
        (images / f"{tag}_{i}.png").write_bytes(base64.b64decode(b64))
    return {"s": took, "split_s": split_from_response(raw.headers, body)}


async def _serve_load(server: Server, args, extra: dict, system: str) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=3600, max_retries=0)
    t0 = time.perf_counter()
    await _send(client, args, 99, extra, None, system)  # full-size warm-up
    out: dict = {"warmup_s": round(time.perf_counter() - t0, 2)}
    print(f"{system}: warm-up {out['warmup_s']} s", flush=True)
    singles = [
        await _send(client, args, i, extra, args.out / "images", system)
        for i in range(args.singles)
    ]
    if singles:
        out["c1_runs_s"] = [round(r["s"], 2) for r in singles]
        out["c1_s"] = round(statistics.median(r["s"] for r in singles), 2)
        out["c1_split_s"] = [r["split_s"] for r in singles]
        print(f"{system}: c1 {out['c1_runs_s']} split {out['c1_split_s']}", flush=True)

    async def send(i: int) -> dict:
        return await _send(client, args, i, extra, None, system)

    if args.requests:
        closed = await closed_loop(send, args.requests, args.concurrency)
        out["closed"] = closed.summary()
        print(f"{system}: closed {out['closed']}", flush=True)
    if args.rate:
        opened = await open_loop(
            send, args.requests or args.concurrency, args.rate, seed=args.round
        )
        out["open"] = opened.summary()
        print(f"{system}: open {out['open']}", flush=True)
    return out


def run_served(args, system: str, deploys: dict) -> dict:
    argv, env, reserved = server_argv(args, system, deploys)
    baseline = used_gib()
    server = Server(argv, args.out / f"{system}_r{args.round}.log", env=env)
    try:
        with PeakMemory() as mem:
            ready = server.wait_ready(args.start_timeout)
            print(f"{system}: ready in {ready:.1f} s", flush=True)
            load = asyncio.run(_serve_load(server, args, FAMILIES[args.family][1], system))
    finally:
        server.stop()
        _keep_log_lines(server.log, args.out / f"{system}_r{args.round}_log_lines.txt")
    return {
        "ready_s": round(ready, 1),
        **load,
        "baseline_gib": baseline,
        "peak_gib": mem.peak_gib,
        "reserved": reserved,
    }


def run_diffusers(args) -> dict:
    """diffusers in a fresh process (its memory gone when it ends); one request at a time."""
    cmd = [
        sys.executable,
        __file__,
        "diffusers-one",
        "--family",
        args.family,
        "--model",
        str(args.model),
    ]
    cmd += [
        "--out",
        str(args.out),
        "--size",
        str(args.size),
        "--steps",
        str(args.steps),
        "--singles",
        str(args.singles),
    ]
    baseline = used_gib()
    with PeakMemory() as mem:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    (args.out / f"diffusers_r{args.round}.log").write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith('{"diffusers"')]
    if proc.returncode or not lines:
        raise RuntimeError(f"diffusers run failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(lines[-1])["diffusers"]
    return {
        **result,
        "baseline_gib": baseline,
        "peak_gib": mem.peak_gib,
        "reserved": {"shares": None, "note": "no reservation: allocates as it goes"},
    }


def round_order(systems: list[str], r: int) -> list[str]:
    """Round r's order: the systems rotated left by r, so each runs first, second, ... in turn
    and none always profits from (or pays for) the machine state its predecessor left."""
    k = r % len(systems)
    return systems[k:] + systems[:k]


def phase_run(args) -> None:
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    deploys = incumbent_deploys(args) if any(s.startswith("omni") for s in systems) else {}
    if deploys:
        (args.out / f"incumbent_{args.family}.json").write_text(json.dumps(deploys, indent=1))
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    for r in range(args.round_offset, args.round_offset + args.rounds):
        order = round_order(systems, r)
        for position, system in enumerate(order):
            args.round = r
            t0 = time.perf_counter()
            data = (
                run_diffusers(args) if system == "diffusers" else run_served(args, system, deploys)
            )
            record = {
                "phase": "fair", "family": args.family, "system": system, "round": r,
                "position": position, "order": order, "device": device, "size": args.size,
                "steps": args.steps, "run_s": round(time.perf_counter() - t0, 1), **data,
            }  # fmt: skip
            if system.startswith("omni"):
                record["changes"] = deploys["changes"] if system == "omni-tuned" else []
            if system == "diffusers":
                record["label"] = "one request at a time"
            record["versions"] = _versions()
            with open(args.out / "results.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)


def phase_deploy(args) -> None:
    deploys = incumbent_deploys(args)
    print(json.dumps(deploys, indent=1))


# ---- diffusers, in its own process -----------------------------------------------------------
def _timed(fn, box: list):
    import torch

    def wrapper(*a, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        box.append(time.perf_counter() - t0)
        return out

    return wrapper


def phase_diffusers_one(args) -> None:
    """Load, warm up at full size, then `--singles` images one at a time; prints one JSON line.
    Split: the text side (GLM: the AR's generate; Qwen: encode_prompt), the VAE decode, the
    rest (denoising). Compares each image with ours of the same prompt and seed when
    OUT/images/ours_<i>.png exists (Qwen-Image: deterministic given the seed)."""
    import diffusers
    import torch
    from PIL import Image

    cls = getattr(diffusers, FAMILIES[args.family][2])
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    t0 = time.perf_counter()
    pipe = cls.from_pretrained(str(args.model), torch_dtype=dtype)
    pipe.to("cuda" if torch.cuda.is_available() else "cpu")
    load_s = time.perf_counter() - t0
    text_s, decode_s = [], []
    if args.family == "glm-image":
        pipe.vision_language_encoder.generate = _timed(
            pipe.vision_language_encoder.generate, text_s
        )
    else:
        pipe.encode_prompt = _timed(pipe.encode_prompt, text_s)
    pipe.vae.decode = _timed(pipe.vae.decode, decode_s)
    extra = FAMILIES[args.family][1]
    kw = dict(height=args.size, width=args.size, num_inference_steps=args.steps, **extra)
    t0 = time.perf_counter()
    pipe(PROMPTS[99 % len(PROMPTS)], generator=torch.Generator("cpu").manual_seed(1099), **kw)
    warmup = time.perf_counter() - t0
    text_s.clear(), decode_s.clear()
    runs, splits, diffs = [], [], {}
    for i in range(args.singles):
        t0 = time.perf_counter()
        image = pipe(
            PROMPTS[i % len(PROMPTS)], generator=torch.Generator("cpu").manual_seed(1000 + i), **kw
        ).images[0]
        runs.append(time.perf_counter() - t0)
        split = {"text": round(text_s[-1], 3), "decode": round(decode_s[-1], 3)}
        split["denoise"] = round(runs[-1] - split["text"] - split["decode"], 3)
        splits.append(split)
        (args.out / "images").mkdir(parents=True, exist_ok=True)
        image.save(args.out / "images" / f"diffusers_{i}.png")
        ours = args.out / "images" / f"ours_{i}.png"
        if args.family == "qwen-image" and ours.exists():
            diffs[str(i)] = pixel_diff(image, Image.open(io.BytesIO(ours.read_bytes())))
    result = {
        "load_s": round(load_s, 1),
        "warmup_s": round(warmup, 2),
        "c1_runs_s": [round(r, 2) for r in runs],
        "c1_s": round(statistics.median(runs), 2),
        "c1_split_s": splits,
        "images_per_min_one_at_a_time": round(60 / statistics.median(runs), 3),
    }
    if diffs:
        result["ours_vs_diffusers_mean_abs_pixel_diff"] = diffs
    print(json.dumps({"diffusers": result}), flush=True)


def pixel_diff(a, b) -> float:
    """Mean absolute difference of two images' RGB pixels, of 255."""
    import numpy as np

    x = np.asarray(a.convert("RGB"), np.float32)
    y = np.asarray(b.convert("RGB"), np.float32)
    if x.shape != y.shape:
        raise ValueError(f"image sizes differ: {x.shape} vs {y.shape}")
    return round(float(np.abs(x - y).mean()), 3)


def phase_compare(args) -> None:
    """Ours vs diffusers on the same prompt and seed, from the PNGs both runs saved (the two may
    have run in different calls): one `parity` line per pair in results.jsonl."""
    from PIL import Image

    pairs = {}
    for ours in sorted((args.out / "images").glob("ours_*.png")):
        ref = ours.with_name(ours.name.replace("ours_", "diffusers_"))
        if ref.exists():
            pairs[ours.stem.removeprefix("ours_")] = pixel_diff(Image.open(ours), Image.open(ref))
    record = {"phase": "parity", "family": args.family, "mean_abs_pixel_diff": pairs}
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["run", "deploy", "diffusers-one", "compare"])
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/bench-fair")))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--round-offset",
        type=int,
        default=0,
        help="first round's index (continuing in a later call)",
    )
    parser.add_argument(
        "--singles", type=int, default=2, help="requests one at a time (concurrency 1)"
    )
    parser.add_argument("--requests", type=int, default=32, help="closed loop: requests in all")
    parser.add_argument(
        "--concurrency", type=int, default=8, help="closed loop: requests in flight"
    )
    parser.add_argument("--rate", type=float, default=None, help="open loop: arrivals per second")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument(
        "--stage-config", default=None, help="ours (default: the family's one-GPU config)"
    )
    parser.add_argument("--stage-overrides", default=None)
    parser.add_argument("--omni-path", default=os.environ.get("OMNI_PYTHONPATH", "/tmp/vomni"))
    parser.add_argument("--start-timeout", type=float, default=900)
    args = parser.parse_args()
    args.stage_config = args.stage_config or FAMILIES[args.family][0]
    args.round = args.round_offset
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase not in ("deploy", "compare") and args.model is None:
        parser.error("--model is required")
    phases = {"run": phase_run, "deploy": phase_deploy, "compare": phase_compare}
    phases["diffusers-one"] = phase_diffusers_one
    phases[args.phase](args)


if __name__ == "__main__":
    main()
