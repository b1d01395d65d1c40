"""Wan2.2 video generation on one GPU, seconds per video job: vllm-omni-plugin serving
`/v1/videos` (`vllm serve MODEL --stage-config wan2_2_ti2v`) beside vLLM-Omni 0.26 serving the
same route (`vllm serve MODEL --omni --deploy-config` its own `deploy/wan2_2_ti2v.yaml`, as
shipped; `--omni-deploy ''` for a model it ships no file for) and diffusers' WanPipeline, on the
same request.

    python benchmarks/bench_video.py --model DIR --out OUT [--size 1280x704 --frames 121
        --steps 50 --jobs 2 --levels 1,2 --systems ours,omni,diffusers --budget-s 540
        --omni-path /tmp/vomni]
    python benchmarks/bench_video.py report OUT/results.jsonl   # the table again
    python benchmarks/bench_video.py report benchmarks/results/wan_video_*.jsonl \
        --write BENCHMARKS.md   # between its `<!-- wan-video:begin -->` and `... end -->`

The model is a full-size random-weight Wan2.2 TI2V-5B (`vllm-omni-plugin make-tiny-model
wan-ti2v DIR --size full`, vllm_omni_plugin/testing/full_wan.py) or any WanPipeline folder.

ours and omni (vLLM-Omni, installed in `--omni-path`): the server starts fresh (ours: its job
store a folder of OUT, removed when it stops), gets one warm-up job (full size and frames,
`--warmup-steps` steps: the same shapes, so compiles and graphs are done before timing), then for
each level C of `--levels`, max(`--jobs`, C) jobs with at most C in flight (each new job created
as soon as one finishes). Both get the same create request, as a form (the official client's
way; vLLM-Omni's route takes forms only). A job's seconds run from its create request to the
first poll (every `--poll-s`) that finds it `completed`; the MP4 is then downloaded (timed apart)
and its frame count checked. Each job records its size, frames and steps as the server reports
them.

diffusers: WanPipeline.from_pretrained in this process (bf16 on the GPU, float32 on a CPU), one
warm-up call with `--warmup-steps`, then `--jobs` calls one at a time (batch 1): same prompt,
size, frames, steps, guidance and seeds; each call timed with the device synchronized before
and after, frames returned as numpy (no MP4 encoding: the served time includes it).

Each finished (system, level) appends one JSON line to OUT/results.jsonl, with the device, the
versions of vllm, torch and diffusers, the command and each job's seconds; a (system, level)
already there for the same size, frames and steps is not run again, so the same command
continues where a run cut short stopped. With `--budget-s`, a server start (or diffusers' load)
and each job start only if their estimates fit what is left (a start and warm-up as last
measured, else `--first-start-s`; a job as the slowest of its level so far, else as last
measured, else `--first-job-s`); a level the budget cut short is recorded with the jobs that
finished (`partial`) and not run again, so every call makes progress; one that failed is
recorded with its `error` and not run again either (remove its line to retry). The run prints
`STOPPED: ...`, or `ALL_DONE` once every (system, level) is recorded. The table (median,
min-max, n, and each row's median over diffusers' median) is printed at the end and written to
OUT/table.md.

CPU dry run on the tiny checkpoint (the build ~6 s, the run ~20 s on 2 cores)::

    vllm-omni-plugin make-tiny-model wan-ti2v /tmp/wan-ti2v-tiny
    python benchmarks/bench_video.py --model /tmp/wan-ti2v-tiny --out /tmp/wan-video-dry \\
        --stage-config wan_ti2v_tiny --size 64x64 --frames 9 --steps 4 --jobs 2 --warmup-steps 1 \\
        --poll-s 0.05

and of the full-size code path (every width as published, one layer per stack: 2.2B parameters,
built in ~40 s; the run ~65 s, both systems in float32)::

    vllm-omni-plugin make-tiny-model wan-ti2v /dev/shm/wan-full-1 --size full --num-layers 1
    python benchmarks/bench_video.py --model /dev/shm/wan-full-1 --out /tmp/wan-video-full-1 \\
        --stage-config wan_ti2v_tiny --size 64x64 --frames 5 --steps 2 --jobs 1 --levels 1 \\
        --warmup-steps 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fair import omni_env  # noqa: E402
from bench_gpu_glm import PeakMemory, Server, _versions  # noqa: E402
from fair_report import write_into  # noqa: E402

PROMPTS = [
    "a red fox running through fresh snow, slow motion",
    "waves breaking on a rocky beach at sunset",
    "a paper boat drifting down a rain-soaked street",
    "a hot air balloon rising over green hills at dawn",
]
SEED0 = 1000
GUIDANCE = 5.0  # TI2V-5B's card and wan2_2_ti2v.yaml's default
SYSTEMS = ("ours", "omni", "diffusers")
SERVED = ("ours", "omni")
REPORT_BEGIN, REPORT_END = "<!-- wan-video:begin -->", "<!-- wan-video:end -->"
# vLLM-Omni's own deploy files, under its package (it ships one for Wan2.2 TI2V-5B).
OMNI_DEPLOY_DIR = Path("vllm_omni") / "deploy"


# ---- shared ------------------------------------------------------------------------------------
def parse_size(size: str) -> tuple[int, int]:
    width, _, height = size.partition("x")
    return int(width), int(height)


def device_name() -> str:
    """The GPU's name from nvidia-smi (no CUDA context in this process), else "cpu"."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    names = out.stdout.strip().splitlines()
    return names[0].strip() if out.returncode == 0 and names else "cpu"


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = _versions()
    try:
        out["vllm-omni-plugin"] = version("vllm-omni-plugin")
    except PackageNotFoundError:
        pass
    return out


def same_request(record: dict, args) -> bool:
    return (record.get("size"), record.get("frames"), record.get("steps")) == (
        args.size,
        args.frames,
        args.steps,
    )


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_record(args, record: dict) -> None:
    record = {
        **record,
        "size": args.size,
        "frames": args.frames,
        "steps": args.steps,
        "guidance_scale": args.guidance,
        "device": record.get("device") or device_name(),
        "versions": versions(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    brief = {k: v for k, v in record.items() if k not in ("jobs", "versions", "command")}
    print(json.dumps(brief), flush=True)


def summarize(seconds: list[float]) -> dict:
    return {
        "median_s": round(statistics.median(seconds), 2),
        "min_s": round(min(seconds), 2),
        "max_s": round(max(seconds), 2),
        "n": len(seconds),
    }


class Budget:
    """What is left of `--budget-s` (None: no limit), and estimates from earlier records."""

    def __init__(self, args, records: list[dict]):
        self.args, self.records, self.t0 = args, records, time.monotonic()

    def left(self) -> float | None:
        if self.args.budget_s is None:
            return None
        return self.args.budget_s - (time.monotonic() - self.t0)

    def latest(self, system: str, key: str) -> float | None:
        for record in reversed(self.records):
            if record.get("system") == system and record.get(key) is not None:
                return float(record[key])
        return None

    def start_s(self, system: str) -> float:
        """A server start (or pipeline load) plus its warm-up."""
        ready, warm = self.latest(system, "ready_s"), self.latest(system, "warmup_s")
        if ready is None or warm is None:
            return self.args.first_start_s
        return 1.1 * (ready + warm)

    def job_s(self, system: str, level: int, seen: list[float] = ()) -> float:
        """One more job at concurrency `level`: the slowest seen in this level, else the latest
        measured seconds per job (a job among C at once takes about C times one alone), else
        `--first-job-s` times C."""
        if seen:
            return 1.1 * max(seen)
        per_job = self.latest(system, "wall_s_per_job") or self.args.first_job_s
        return 1.1 * per_job * level

    def room_for(self, need: float) -> bool:
        left = self.left()
        return left is None or need <= left

    def stop(self, what: str) -> bool:
        left = self.left()
        print(f"STOPPED: {what} did not fit the {left or 0:.0f} s left", flush=True)
        return False

    def fits(self, need: float, what: str) -> bool:
        left = self.left()
        if left is not None and need > left:
            print(f"STOPPED: {what} needs ~{need:.0f} s, {left:.0f} s left", flush=True)
            return False
        return True


# ---- ours: /v1/videos jobs -----------------------------------------------------------------------
def mp4_frames(mp4: bytes) -> int:
    """The frames of an MP4's video stream, from its index (no decoding)."""
    import io

    import av

    with av.open(io.BytesIO(mp4)) as container:
        return container.streams.video[0].frames


def video_form(args, i: int, steps: int) -> dict[str, str]:
    """The create request's fields, as the form's text values."""
    return {
        "model": str(args.model),
        "prompt": PROMPTS[i % len(PROMPTS)],
        "size": args.size,
        "num_frames": str(args.frames),
        "num_inference_steps": str(steps),
        "guidance_scale": str(args.guidance),
        "seed": str(SEED0 + i),
    }


def checked(response):
    """The response, or an error naming the route, the status and the server's message."""
    if response.is_success:
        return response
    request = response.request
    raise RuntimeError(
        f"{request.method} {request.url.path}: {response.status_code} {response.text[:1000]}"
    )


async def run_job(client, args, i: int, steps: int) -> dict:
    """Create a job, poll it until completed, download and check its MP4."""
    t0 = time.perf_counter()
    job = checked(await client.post("/v1/videos", data=video_form(args, i, steps))).json()
    while job["status"] not in ("completed", "failed"):
        await asyncio.sleep(args.poll_s)
        job = checked(await client.get(f"/v1/videos/{job['id']}")).json()
    took = time.perf_counter() - t0
    if job["status"] != "completed":
        raise RuntimeError(f"job {job['id']} failed: {job.get('error')}")
    t1 = time.perf_counter()
    mp4 = checked(await client.get(f"/v1/videos/{job['id']}/content")).content
    download = time.perf_counter() - t1
    frames = mp4_frames(mp4)
    if frames != args.frames:
        raise RuntimeError(f"job {job['id']}: {frames} frames in its MP4, not {args.frames}")
    return {
        "s": round(took, 3),
        "download_s": round(download, 3),
        "server_s": (job["completed_at"] - job["created_at"])
        if job.get("completed_at") and job.get("created_at")
        else None,
        "size": job.get("size"),
        "frames": frames,
        "steps": steps,
        "seconds": job.get("seconds"),
        "mp4_bytes": len(mp4),
        "seed": SEED0 + i,
    }


async def level_jobs(
    client, args, system: str, level: int, budget: Budget
) -> tuple[list[dict], float]:
    """max(--jobs, level) jobs, at most `level` in flight; a job starts only while the budget
    has room for it (the jobs that finished are returned)."""
    total, jobs, started = max(args.jobs, level), [], []

    async def worker() -> None:
        while len(started) < total:
            if not budget.room_for(budget.job_s(system, level, [j["s"] for j in jobs])):
                return
            i = len(started)
            started.append(i)
            result = await run_job(client, args, i, args.steps)
            jobs.append(result)
            print(f"{system} c{level}: job {i} {result['s']:.2f} s", flush=True)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(min(level, total))])
    return jobs, time.perf_counter() - t0


def ours_deploy(args, store: Path) -> Path:
    """`--stage-config` with its job store in `store` (this run's, not the user's cache). A
    section of a file that names a `base_config` replaces the base's whole section: the file
    repeats every resolved `videos` setting."""
    import yaml

    from vllm_omni_plugin.config.resolve import load_deploy_config

    videos = load_deploy_config(args.stage_config).videos.model_dump(mode="json")
    base = Path(args.stage_config).expanduser()
    text = yaml.safe_dump(
        {
            "base_config": str(base.resolve()) if base.exists() else args.stage_config,
            "videos": {**videos, "store_dir": str(store.resolve())},
        },
        sort_keys=False,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"ours_{Path(args.stage_config).stem}.yaml"
    path.write_text(text)
    return path


def omni_deploy(args) -> Path | None:
    """vLLM-Omni's shipped deploy file `--omni-deploy` in the vLLM-Omni at `--omni-path`; None
    when it is empty (vLLM-Omni's own defaults for the model: it ships no file for the A14B)."""
    if not args.omni_deploy:
        return None
    path = Path(args.omni_path) / OMNI_DEPLOY_DIR / args.omni_deploy
    if not path.is_file():
        raise FileNotFoundError(f"no {OMNI_DEPLOY_DIR / args.omni_deploy} under --omni-path "
                                f"{args.omni_path}")  # fmt: skip
    return path


def served(args, system: str, store: Path) -> tuple[list[str], dict[str, str], dict]:
    """`vllm serve` argv, extra env, and what the record says of the system's configuration."""
    if system == "ours":
        argv = [str(args.model), "--stage-config", str(ours_deploy(args, store))]
        if args.stage_overrides:
            argv += ["--stage-overrides", args.stage_overrides]
        return (
            argv,
            {},
            {"stage_config": args.stage_config, "stage_overrides": args.stage_overrides},
        )
    deploy = omni_deploy(args)
    argv = [str(args.model), "--omni"]
    if deploy is not None:
        argv += ["--deploy-config", str(deploy)]
    config = {"deploy_config": str(deploy) if deploy else "vLLM-Omni's defaults", "changes": []}
    return argv, omni_env(args), config


def run_served(args, system: str, budget: Budget, pending: list[int]) -> bool:
    """Serve, warm up, run the pending levels; False when the budget stopped it."""
    import httpx

    need = budget.start_s(system) + budget.job_s(system, pending[0])
    if not budget.fits(need, f"{system} (start + a job at c{pending[0]})"):
        return False
    stamp = time.strftime("%H%M%S")
    store = args.out / f"video_store_{stamp}"
    argv, env, config = served(args, system, store)
    server = Server(argv, args.out / f"{system}_{stamp}.log", env)
    finished = True
    try:
        with PeakMemory() as mem:
            ready = server.wait_ready(args.start_timeout)
            print(f"{system}: ready in {ready:.1f} s", flush=True)

            async def drive() -> bool:
                async with httpx.AsyncClient(base_url=server.url, timeout=7200) as client:
                    t0 = time.perf_counter()
                    await run_job(client, args, len(PROMPTS) - 1, args.warmup_steps)
                    warmup = time.perf_counter() - t0
                    print(f"{system}: warm-up {warmup:.1f} s", flush=True)
                    for level in pending:
                        if not budget.fits(budget.job_s(system, level), f"{system} c{level}"):
                            return False
                        jobs, wall = await level_jobs(client, args, system, level, budget)
                        if not jobs:
                            return budget.stop(f"a job at {system} c{level}")
                        record = {
                            "system": system,
                            "level": level,
                            **config,
                            "ready_s": round(ready, 1),
                            "warmup_s": round(warmup, 1),
                            "wall_s": round(wall, 2),
                            "wall_s_per_job": round(wall / len(jobs), 2),
                            **summarize([j["s"] for j in jobs]),
                            "jobs": jobs,
                            "partial": len(jobs) < max(args.jobs, level),
                            "peak_gib": mem.peak_gib,
                        }
                        budget.records.append(record)
                        write_record(args, record)
                        if record["partial"]:
                            return budget.stop(f"the rest of {system} c{level}")
                    return True

            finished = asyncio.run(drive())
    finally:
        server.stop()
        shutil.rmtree(store, ignore_errors=True)
    return finished


# ---- diffusers: WanPipeline in this process ----------------------------------------------------
def wait_gpu_idle(timeout_s: float = 90.0) -> None:
    """Until no process holds GPU memory (a stopped server's engine can take seconds to let go);
    returns at once without nvidia-smi (a CPU run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            return
        if out.returncode != 0 or not out.stdout.strip():
            return
        time.sleep(1)
    print(f"GPU still held after {timeout_s:.0f} s; going on", flush=True)


def run_diffusers(args, budget: Budget) -> bool:
    need = budget.start_s("diffusers") + budget.job_s("diffusers", 1)
    if not budget.fits(need, "diffusers (load + a job)"):
        return False
    wait_gpu_idle()
    import torch
    from diffusers import WanPipeline

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    width, height = parse_size(args.size)

    def call(i: int, steps: int) -> float:
        sync()
        t0 = time.perf_counter()
        out = pipe(
            prompt=PROMPTS[i % len(PROMPTS)],
            height=height,
            width=width,
            num_frames=args.frames,
            num_inference_steps=steps,
            guidance_scale=args.guidance,
            generator=torch.Generator("cpu").manual_seed(SEED0 + i),
            output_type="np",
        ).frames[0]
        sync()
        took = time.perf_counter() - t0
        if out.shape[:3] != (args.frames, height, width):
            raise RuntimeError(f"diffusers made {out.shape}, not {args.frames}x{height}x{width}")
        return took

    with PeakMemory() as mem:
        t0 = time.perf_counter()
        pipe = WanPipeline.from_pretrained(str(args.model), dtype=dtype).to(device)
        pipe.set_progress_bar_config(disable=True)
        loaded = time.perf_counter() - t0
        print(f"diffusers: loaded in {loaded:.1f} s", flush=True)
        warmup = call(len(PROMPTS) - 1, args.warmup_steps)
        print(f"diffusers: warm-up {warmup:.1f} s", flush=True)
        jobs: list[dict] = []
        for i in range(args.jobs):
            if not budget.room_for(budget.job_s("diffusers", 1, [j["s"] for j in jobs])):
                break
            took = call(i, args.steps)
            print(f"diffusers: job {i} {took:.2f} s", flush=True)
            jobs.append(
                {
                    "s": round(took, 3),
                    "size": args.size,
                    "frames": args.frames,
                    "steps": args.steps,
                    "seed": SEED0 + i,
                }
            )
    if not jobs:
        return budget.stop("a diffusers job")
    seconds = [j["s"] for j in jobs]
    record = {
        "system": "diffusers",
        "level": 1,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "ready_s": round(loaded, 1),
        "warmup_s": round(warmup, 1),
        "wall_s": round(sum(seconds), 2),
        "wall_s_per_job": round(sum(seconds) / len(seconds), 2),
        **summarize(seconds),
        "jobs": jobs,
        "partial": len(jobs) < args.jobs,
        "peak_gib": mem.peak_gib,
    }
    budget.records.append(record)
    write_record(args, record)
    if record["partial"]:
        return budget.stop("the rest of the diffusers jobs")
    return True


# ---- table -------------------------------------------------------------------------------------
def table(records: list[dict]) -> str:
    """One row per (system, level), the latest record of each: median, min-max and n of the
    seconds per job, the level's wall time per job, and the median over diffusers' median."""
    latest: dict[tuple, dict] = {}
    for r in records:
        latest[(r["size"], r["frames"], r["steps"], r["system"], r["level"])] = r
    lines = []
    for shape in sorted({k[:3] for k in latest}):
        size, frames, steps = shape
        rows = [r for k, r in latest.items() if k[:3] == shape]
        ref = next(
            (r for r in rows if (r["system"], r["level"]) == ("diffusers", 1) and "error" not in r),
            None,
        )
        device = rows[0].get("device", "?")
        lines += [
            f"Wan2.2 video jobs, {size}, {frames} frames, {steps} steps, guidance "
            f"{rows[0].get('guidance_scale')}, on {device}: seconds per job",
            "",
            "| system | concurrency | median s | min-max s | n | wall s per job | vs diffusers |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in sorted(rows, key=lambda r: (SYSTEMS.index(r["system"]), r["level"])):
            if "error" in r:
                # A failed job's error ends with the server's message: show its start.
                error = r["error"].splitlines()[0].split("'message': '", 1)[-1]
                error = error[:100].replace("|", "/")
                lines.append(f"| {r['system']} | {r['level']} | failed: {error} | | | | |")
                continue
            ratio = f"{r['median_s'] / ref['median_s']:.2f}x" if ref else "-"
            n = f"{r['n']} (partial)" if r.get("partial") else str(r["n"])
            lines.append(
                f"| {r['system']} | {r['level']} | {r['median_s']:.2f} | "
                f"{r['min_s']:.2f}-{r['max_s']:.2f} | {n} | {r['wall_s_per_job']:.2f} | {ratio} |"
            )
        lines.append("")
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------
def run(args) -> int:
    if args.size != f"{parse_size(args.size)[0]}x{parse_size(args.size)[1]}":
        raise SystemExit(f"--size must be WIDTHxHEIGHT, got {args.size!r}")
    records = read_records(args.out / "results.jsonl")
    budget = Budget(args, records)
    done = {(r["system"], r["level"]) for r in records if same_request(r, args)}
    finished = True
    for system in args.systems:
        levels = args.levels if system in SERVED else [1]
        pending = [level for level in levels if (system, level) not in done]
        if not pending:
            print(f"{system}: already recorded", flush=True)
            continue
        try:
            ok = (
                run_served(args, system, budget, pending)
                if system in SERVED
                else run_diffusers(args, budget)
            )
        except Exception as exc:  # recorded, so that the next call moves on to the rest
            # From the file: the records in memory lack the request fields write_record adds.
            written = read_records(args.out / "results.jsonl")
            recorded = {(r["system"], r["level"]) for r in written if same_request(r, args)}
            level = next(lvl for lvl in pending if (system, lvl) not in recorded)
            message = f"{type(exc).__name__}: {exc}"
            print(f"{system} c{level} failed: {message}", flush=True)
            write_record(args, {"system": system, "level": level, "error": message[-4000:]})
            continue
        if not ok:
            finished = False
            break
    text = table(read_records(args.out / "results.jsonl"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    if finished:
        print("ALL_DONE", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        # report FILE... [--write DOC]: the tables of FILEs' records, printed or put between
        # DOC's wan-video markers
        paths, doc = argv[1:], None
        if "--write" in paths:
            at = paths.index("--write")
            paths, doc = paths[:at] + paths[at + 2 :], Path(paths[at + 1])
        text = "\n".join(table(read_records(Path(path))) for path in paths)
        if doc is None:
            print(text)
        else:
            write_into(doc, text, REPORT_BEGIN, REPORT_END)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stage-config", default="wan2_2_ti2v")
    p.add_argument("--stage-overrides", default=None, help="JSON, passed to `vllm serve`")
    p.add_argument("--size", default="1280x704", help="WIDTHxHEIGHT")
    p.add_argument("--frames", type=int, default=121)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--guidance", type=float, default=GUIDANCE)
    p.add_argument("--jobs", type=int, default=2, help="jobs per level (at least the level)")
    p.add_argument("--levels", default="1,2", help="concurrency levels of the servers")
    p.add_argument("--systems", default="ours,diffusers")
    p.add_argument(
        "--omni-path",
        default=os.environ.get("OMNI_PYTHONPATH", "/tmp/vomni"),
        help="the folder vLLM-Omni is installed in (system omni)",
    )
    p.add_argument(
        "--omni-deploy",
        default="wan2_2_ti2v.yaml",
        help="vLLM-Omni's shipped deploy file for the model ('' for its defaults)",
    )
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--poll-s", type=float, default=0.5)
    p.add_argument("--budget-s", type=float, default=None, help="seconds this call may use")
    # Estimates before anything was measured, for TI2V-5B at 1280x704, 121 frames, 50 steps on
    # an H100: ~0.55 PFLOP per transformer pass (27,280 tokens) x 2 (CFG) x 50 steps.
    p.add_argument("--first-start-s", type=float, default=180.0)
    p.add_argument("--first-job-s", type=float, default=120.0)
    p.add_argument("--start-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    args.levels = [int(x) for x in args.levels.split(",") if x]
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown or not args.systems:
        p.error(f"--systems: unknown {sorted(unknown)}; expected some of {', '.join(SYSTEMS)}")
    if not args.levels or min(args.levels) < 1 or args.jobs < 1:
        p.error("--levels and --jobs must be >= 1")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
