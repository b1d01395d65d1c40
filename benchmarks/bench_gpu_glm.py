"""GLM-Image on one GPU, side by side on the same weights: vllm-omni-plugin vs vLLM-Omni vs diffusers.

    python benchmarks/bench_gpu_glm.py PHASE --model DIR --out OUT [--size 1024 --steps 50]

PHASE (each appends one JSON line to OUT/results.jsonl, so phases can run in separate calls):
  ours       `vllm serve DIR --stage-config glm_image_1gpu.yaml`: concurrency 1 (seconds per image,
             split AR / handoff / DiT / decode from the x-omni-stage-timings header) and
             concurrency 8 (images per minute, all 8 must come back)
  omni       `vllm serve DIR --omni --deploy-config` with vLLM-Omni's own glm_image.yaml, both
             stages moved to GPU 0 and the AR's max_tokens set to the grid (random weights never
             emit EOS) and our grid logits processor in its AR engine's `logits_processors`
             (the checkpoint's sequence_bias, as transformers applies it for diffusers; see
             _omni_deploy_yaml): the same requests. Our package is on its path for that class
             only; VLLM_PLUGINS=vllm_omni_register_models keeps our general plugin out
  diffusers  GlmImagePipeline (transformers AR + DiT), one request at a time; then (unless
             --no-engine-parity) our diffusion engine on the same pipeline and prior tokens vs
             diffusers (image difference)
  parity     the served pipeline (greedy AR via --stage-overrides) against diffusers with a greedy
             AR, same prompt and seed: mean pixel difference; and vLLM's greedy AR tokens
             (offline, the AR stage's dtype and eager setting: sub-phase ar-tokens) against
             transformers', the first index where they differ
  report     the three-way table from OUT/results.jsonl (markdown)

Peak GPU memory is the device's used memory, sampled every 0.2 s by NVML while a phase runs
(each phase runs alone on the GPU). Requests: 1024x1024, 50 steps, guidance 1.5 (GLM-Image's
defaults), distinct seeds, b64_json PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPTS = [
    "a lighthouse on a cliff at dusk, oil painting",
    'a shop sign that says "OPEN"',
    "a red fox in fresh snow",
    "an isometric city block at night",
    "a bowl of ramen, studio photo",
    "a watercolor map of an island",
    "a robot reading a book in a library",
    "a sunflower field under a storm",
]


# ---- helpers ---------------------------------------------------------------------------------
class PeakMemory:
    """Highest device memory in use (all processes) while the block runs, in GiB."""

    def __init__(self, index: int = 0, every_s: float = 0.2):
        self.index, self.every_s, self.peak = index, every_s, 0
        self._stop = threading.Event()

    def _used(self) -> int:
        import pynvml

        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(self.index)).used

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakMemory:
        self._thread = None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no NVIDIA device (a CPU dry run): no memory figure
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def peak_gib(self) -> float | None:
        """None when no device was sampled (no NVIDIA device)."""
        return round(self.peak / 2**30, 1) if self._thread is not None else None


def record_group(pid: int) -> None:
    """Note a server's process group in $OMNI_BENCH_PGID_FILE (when set): scripts/gpu_check.sh
    stops every group listed there after each phase, a phase cut short by a timeout included,
    instead of matching process names."""
    path = os.environ.get("OMNI_BENCH_PGID_FILE")
    if path:
        with open(path, "a") as f:
            f.write(f"{pid}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `vllm serve` process in its own session; ready at the first 200 from /health."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.t0 = time.monotonic()
        full_env = {**os.environ, **(env or {})}
        vllm = str(Path(sys.executable).parent / "vllm")
        vllm = vllm if Path(vllm).exists() else "vllm"
        self.proc = subprocess.Popen(
            [vllm, "serve", *argv, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env=full_env,
            # Not the checkout: its vllm_omni_plugin/ would shadow the installed package (which
            # also holds entry_points/) in the stage processes.
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )
        record_group(self.proc.pid)

    def wait_ready(self, timeout: float) -> float:
        import httpx

        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not ready within {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def _one(client, args, i: int, extra: dict) -> dict:
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
    res = raw.parse()
    assert res.data and res.data[0].b64_json, "no image in the response"
    timings = raw.headers.get("x-omni-stage-timings")
    return {
        "s": took,
        "timings": json.loads(timings) if timings else None,
        "b64": res.data[0].b64_json,
    }


async def _serve_load(server: Server, args, extra: dict) -> dict:
    """One warm-up, `--repeats` single requests, then `--concurrency` at once."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=3600, max_retries=0)
    first = await _one(client, args, 99, extra)  # the first request after start-up
    print("first request:", round(first["s"], 2), flush=True)
    singles = [await _one(client, args, i, extra) for i in range(args.repeats)]
    # Printed now, so that a run cut short at concurrency 8 still leaves its concurrency-1 figures.
    print("c1:", [(round(r["s"], 2), r["timings"]) for r in singles], flush=True)
    t0 = time.perf_counter()
    many = await asyncio.gather(*[_one(client, args, i, extra) for i in range(args.concurrency)])
    wall = time.perf_counter() - t0
    out = {
        "first_request_s": round(first["s"], 2),
        "c1_s_per_image": round(statistics.median(r["s"] for r in singles), 2) if singles else None,
        "c1_runs_s": [round(r["s"], 2) for r in singles],
        f"c{args.concurrency}_images": len(many),
        f"c{args.concurrency}_wall_s": round(wall, 1),
        f"c{args.concurrency}_images_per_min": round(len(many) * 60 / wall, 2),
    }
    if singles and singles[0]["timings"]:
        keys = singles[0]["timings"].keys()
        out["c1_split_s"] = {
            k: round(statistics.median(r["timings"][k] for r in singles) / 1e3, 2) for k in keys
        }
    return out


def _connector_counters(server: Server) -> dict[str, float]:
    """The stage connectors' counters from /metrics (which connector carried the handoffs, how
    many, how many failed, their latency): the served run's own word on the path it took."""
    import httpx

    wanted = ("transfers_total", "failures_total", "bytes_total", "latency_seconds_sum")
    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith("omni_connector_") and any(w + "{" in line for w in wanted):
            key, _, value = line.rpartition(" ")
            out[key.removeprefix("omni_connector_")] = float(value)
    return out


def _record(args, phase: str, data: dict) -> None:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    data = {"phase": phase, "device": device, **data}
    data.update(size=args.size, steps=args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(data) + "\n")
    print(json.dumps(data), flush=True)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("vllm", "vllm-omni", "diffusers", "transformers", "torch"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


# ---- phases ----------------------------------------------------------------------------------
def _serve_phase(args, phase: str, argv: list[str]) -> None:
    """Start `vllm serve argv`, load it (warm-up, concurrency 1, then 8), record, stop; with
    --restart, start it once more (compile caches now warm) and time start-up + one request."""
    server = Server(argv, args.out / f"{phase}.log")
    try:
        with PeakMemory() as mem:
            ready = server.wait_ready(args.start_timeout)
            load = asyncio.run(_serve_load(server, args, {"guidance_scale": 1.5}))
        if phase == "ours":
            load["connector_counters"] = _connector_counters(server)
    finally:
        server.stop()
        _keep_log_lines(server.log, args.out / f"{phase}_log_lines.txt")
    if args.restart:
        load.update(_restart(args, phase, argv))
    config = {"stage_config": args.stage_config} if phase == "ours" else {}
    _record(args, phase, {**config, "ready_s": round(ready, 1), **load, "peak_gib": mem.peak_gib})


def _restart(args, phase: str, argv: list[str]) -> dict:
    """A second start of the same server: what the on-disk compile caches save a restart."""
    from openai import AsyncOpenAI

    server = Server(argv, args.out / f"{phase}_restart.log")
    try:
        ready = server.wait_ready(args.start_timeout)
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=3600)
        first = asyncio.run(_one(client, args, 99, {"guidance_scale": 1.5}))
    finally:
        server.stop()
    return {"restart_ready_s": round(ready, 1), "restart_first_request_s": round(first["s"], 2)}


def phase_ours(args) -> None:
    argv = [str(args.model), "--stage-config", args.stage_config]
    if args.stage_overrides:
        argv += ["--stage-overrides", args.stage_overrides]
    _serve_phase(args, "ours", argv)


def _omni_deploy_yaml(path: Path, size: int) -> Path:
    """vLLM-Omni's own glm_image.yaml with both stages moved to GPU 0, and one more change that
    random weights need: its AR stops at EOS, which trained weights emit right after the grid
    (1281 tokens at 1024x1024) and random weights practically never do (it would run to the
    4353-token ceiling), so the AR's max_tokens is set to the grid's budget for `size`."""
    import vllm_omni
    import yaml

    from vllm_omni_plugin.families.glm_image.processing import num_image_tokens
    from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR

    src = Path(vllm_omni.__file__).parent / "deploy" / "glm_image.yaml"
    cfg = yaml.safe_load(src.read_text())
    for stage in cfg["stages"]:
        stage["devices"] = "0"
    ar = cfg["stages"][0]
    ar["default_sampling_params"]["max_tokens"] = num_image_tokens(size, size) + 1
    # The checkpoint's generation_config (sequence_bias keeps ids inside the DiT's codebook)
    # applied as transformers applies it for diffusers: vLLM ignores those fields.
    ar["logits_processors"] = [LOGITS_PROCESSOR]
    path.write_text(yaml.safe_dump(cfg))
    return path


def phase_omni(args) -> None:
    deploy = _omni_deploy_yaml(args.out / "omni_glm_image_1gpu.yaml", args.size)
    _serve_phase(args, "omni", [str(args.model), "--omni", "--deploy-config", str(deploy)])


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, box: list):
    def wrapper(*a, **kw):
        _sync()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync()
        box.append(time.perf_counter() - t0)
        return out

    return wrapper


def _device_dtype():
    import torch

    return ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)


def _load_diffusers(model: Path):
    from diffusers import GlmImagePipeline

    device, dtype = _device_dtype()
    return GlmImagePipeline.from_pretrained(str(model), torch_dtype=dtype).to(device)


def phase_diffusers(args) -> None:
    import torch

    with PeakMemory() as mem:
        t0 = time.perf_counter()
        pipe = _load_diffusers(args.model)
        load_s = time.perf_counter() - t0
        ar_s, decode_s = [], []
        pipe.vision_language_encoder.generate = _timed(pipe.vision_language_encoder.generate, ar_s)
        pipe.vae.decode = _timed(pipe.vae.decode, decode_s)
        pipe("warm-up", height=256, width=256, num_inference_steps=2)  # kernels, autotune
        ar_s.clear(), decode_s.clear()
        runs = []
        for i in range(args.repeats):
            _sync()
            t0 = time.perf_counter()
            pipe(
                PROMPTS[i],
                height=args.size,
                width=args.size,
                num_inference_steps=args.steps,
                guidance_scale=1.5,
                generator=torch.Generator("cpu").manual_seed(1000 + i),
            )
            _sync()
            runs.append(time.perf_counter() - t0)
    split = {
        "ar": round(statistics.median(ar_s), 2),
        "decode": round(statistics.median(decode_s), 2),
    }
    split["dit"] = round(statistics.median(runs) - split["ar"] - split["decode"], 2)
    _record(
        args,
        "diffusers",
        {
            "load_s": round(load_s, 1),
            "c1_s_per_image": round(statistics.median(runs), 2),
            "c1_runs_s": [round(r, 2) for r in runs],
            "c1_split_s": split,
            "c8_images_per_min": round(60 / statistics.median(runs), 2),  # one at a time
            "peak_gib": mem.peak_gib,
        },
    )
    if args.engine_parity:
        _engine_vs_diffusers(args, pipe)


def _engine_vs_diffusers(args, pipe) -> None:
    """Our diffusion engine on diffusers' own modules and the same prior ids and seed."""
    import numpy as np
    import torch

    from vllm_omni_plugin.diffusion import DiffusionEngine, DiffusionEngineConfig, GenerationRequest
    from vllm_omni_plugin.diffusion.adapters.glm_image import GlmImageAdapter

    d32 = args.size // 32
    gen = torch.Generator("cpu").manual_seed(7)
    vocab = int(pipe.transformer.config.prior_vq_quantizer_codebook_size)
    codes = torch.randint(0, vocab, (1, d32 * d32), generator=gen)
    prior = pipe._upsample_token_ids(codes, d32, d32)
    kwargs = dict(height=args.size, width=args.size, num_inference_steps=args.steps)
    ref = pipe(
        PROMPTS[1],
        prior_token_ids=prior.to(pipe.device),
        guidance_scale=1.5,
        generator=torch.Generator("cpu").manual_seed(5),
        **kwargs,
    ).images[0]
    device, dtype = _device_dtype()
    adapter = GlmImageAdapter(pipe, torch.device(device), dtype, {})
    on_gpu = device == "cuda"
    config = DiffusionEngineConfig(
        model=str(args.model), device=device, dtype=str(dtype).removeprefix("torch."),
        compile_transformer=on_gpu, compile_regional=on_gpu,
    )  # fmt: skip
    engine = DiffusionEngine(config, adapter=adapter)
    req = GenerationRequest(
        request_id="parity", prompt=PROMPTS[1], seed=5, guidance_scale=1.5, prior_token_ids=prior,
        **kwargs,
    )  # fmt: skip
    (out,) = engine.generate([req])
    a = np.asarray(ref, dtype=np.float32)
    b = np.asarray(out.images[0], dtype=np.float32)
    _record(
        args,
        "engine_vs_diffusers",
        {"mean_abs_pixel_diff": round(float(np.abs(a - b).mean()), 3), "pixel_range": 255},
    )


def _sub_phase(args, phase: str, extra: list[str], log: Path, key: str) -> tuple[int, dict | None]:
    """Run `phase` of this script in a fresh process (its own vLLM engine, which needs a file
    to spawn from), its output to `log`: its exit code and result, the last stdout line that
    is a JSON object starting with `key` (vLLM logs to stdout too, its shutdown lines after
    the result), None when there is none."""
    cmd = [sys.executable, __file__, phase, "--model", str(args.model), "--out", str(args.out)]
    proc = subprocess.run(cmd + ["--size", str(args.size), *extra], capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(f'{{"{key}"')]
    return proc.returncode, json.loads(lines[-1]) if lines else None


def phase_ar_tokens(args) -> None:
    """vLLM's greedy AR tokens for the parity prompt (prints one JSON list): the AR stage's
    dtype and enforce_eager from --stage-overrides' stage 0, top_k 1 as the served parity run."""
    from vllm import LLM, SamplingParams

    from vllm_omni_plugin.families.glm_image.processing import (
        build_t2i_prompt,
        t2i_sampling_overrides,
    )
    from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR

    stage = (json.loads(args.stage_overrides) if args.stage_overrides else {}).get("0", {})
    ar, proc = str(args.model / "vision_language_encoder"), str(args.model / "processor")
    llm = LLM(
        model=ar,
        tokenizer=proc,
        dtype=stage.get("dtype", "auto"),
        enforce_eager=bool(stage.get("enforce_eager", False)),
        logits_processors=[LOGITS_PROCESSOR],
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
    )
    prompt = {"prompt_token_ids": build_t2i_prompt(proc, PROMPTS[0], args.size, args.size)}
    params = SamplingParams(top_k=1, **t2i_sampling_overrides(ar, args.size, args.size))
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    print(json.dumps({"ar_tokens": list(out)}), flush=True)


def _hf_greedy_tokens(pipe, size: int) -> list[int]:
    """transformers' greedy AR tokens for the parity prompt, as diffusers' pipeline calls
    `generate` (the processor's ids and grids; the checkpoint's sequence_bias applies)."""
    import torch

    from vllm_omni_plugin.families.glm_image.processing import num_image_tokens

    messages = [[{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}]]
    inputs = pipe.processor.apply_chat_template(
        messages,
        tokenize=True,
        target_h=size,
        target_w=size,
        return_dict=True,
        return_tensors="pt",
    ).to(pipe.vision_language_encoder.device)
    with torch.no_grad():
        out = pipe.vision_language_encoder.generate(
            **inputs, max_new_tokens=num_image_tokens(size, size) + 1, do_sample=False
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def phase_parity(args) -> None:
    """Served (greedy AR) vs diffusers (greedy AR) on one prompt and seed."""
    import numpy as np
    import torch
    from PIL import Image

    greedy = {"0": {"default_sampling_params": {"top_k": 1}}}
    overrides = json.loads(args.stage_overrides) if args.stage_overrides else {}
    for sid, values in greedy.items():
        stage = overrides.setdefault(sid, {})
        stage.setdefault("default_sampling_params", {}).update(values["default_sampling_params"])
    argv = [str(args.model), "--stage-config", args.stage_config]
    argv += ["--stage-overrides", json.dumps(overrides)]
    server = Server(argv, args.out / "parity.log")
    try:
        server.wait_ready(args.start_timeout)
        # All 8 concurrent requests must come back; the first one is compared with diffusers.
        served = asyncio.run(_parity_requests(server, args))
    finally:
        server.stop()
        _keep_log_lines(server.log, args.out / "parity_log_lines.txt")
    # The served image's difference has two sources: the AR's greedy tokens (bf16 can flip a
    # near-tie of a random-weight model, which changes the whole image) and the DiT. vLLM's
    # greedy tokens (the stage's dtype and eager setting) against transformers' tell them apart.
    extra = ["--stage-overrides", json.dumps(overrides)]
    _, vllm = _sub_phase(args, "ar-tokens", extra, args.out / "parity_ar_tokens.log", "ar_tokens")
    pipe = _load_diffusers(args.model)
    hf_tokens = _hf_greedy_tokens(pipe, args.size)
    pipe.vision_language_encoder.generation_config.top_k = 1  # greedy, as the served AR
    ref = pipe(
        PROMPTS[0],
        height=args.size,
        width=args.size,
        num_inference_steps=args.steps,
        guidance_scale=1.5,
        generator=torch.Generator("cpu").manual_seed(1000),
    ).images[0]
    img = Image.open(io.BytesIO(base64.b64decode(served[0]["b64"]))).convert("RGB")
    diff = np.abs(np.asarray(ref, np.float32) - np.asarray(img, np.float32)).mean()
    _record(
        args,
        "parity",
        {
            "model": str(args.model),
            "served_images": len(served),
            "mean_abs_pixel_diff": round(float(diff), 3),
            "ar_tokens": len(hf_tokens),
            # None: vLLM's greedy AR tokens equal transformers' (the image difference is the DiT's)
            "ar_first_difference": (
                "ar-tokens failed: see parity_ar_tokens.log"
                if vllm is None
                else _first_difference(vllm["ar_tokens"], hf_tokens)
            ),
        },
    )


async def _parity_requests(server: Server, args) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=3600, max_retries=0)
    return await asyncio.gather(
        *[_one(client, args, i, {"guidance_scale": 1.5}) for i in range(args.concurrency)]
    )


def _keep_log_lines(log: Path, dest: Path) -> None:
    """The log lines that show how the AR engine ran (async scheduling, CUDA graphs)."""
    keys = ("async", "cudagraph", "CUDA graph", "Capturing", "scheduler", "Graph capturing")
    keys += ("StepBatch", "RequestBatch", "step_execution", "max_num_seqs", "compile")
    lines = [
        ln for ln in log.read_text(errors="replace").splitlines() if any(k in ln for k in keys)
    ]
    dest.write_text("\n".join(lines[:80]) + "\n")


def phase_report(args) -> None:
    rows = {}
    for line in (args.out / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rows[rec["phase"]] = rec
    print(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "phase",
        choices=["ar-tokens", "ours", "omni", "diffusers", "parity", "report"],
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/bench-gpu")))
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--stage-config", default="glm_image_1gpu")
    parser.add_argument("--stage-overrides", default=None)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument(
        "--restart",
        action="store_true",
        help="ours/omni: then start the server again and time start-up + one request",
    )
    parser.add_argument(
        "--engine-parity",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="diffusers phase: also compare our engine's image with diffusers' (one more image)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase != "ar-tokens":
        print("versions:", _versions(), flush=True)
    {
        "ar-tokens": phase_ar_tokens,
        "ours": phase_ours,
        "omni": phase_omni,
        "diffusers": phase_diffusers,
        "parity": phase_parity,
        "report": phase_report,
    }[args.phase](args)


if __name__ == "__main__":
    main()
