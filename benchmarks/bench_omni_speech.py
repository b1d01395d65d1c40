"""Qwen3-Omni speech on one GPU, side by side on the same weights: vllm-omni-plugin
(`--stage-config qwen3_omni_1gpu`) vs vLLM-Omni 0.26 (its own qwen3_omni_moe.yaml on GPU 0,
benchmarks/incumbent.py lists every change). Each run starts its server fresh, measures, and
appends one JSON line to OUT/results.jsonl; rounds alternate the systems (ours, theirs, ours, ...).

    python benchmarks/bench_omni_speech.py run --model DIR --out OUT --rounds 3 --budget-s 540
    python benchmarks/bench_omni_speech.py deploy --out OUT          # the incumbent's file only
    python benchmarks/omni_speech_report.py OUT/results.jsonl --write BENCHMARKS.md

Fixed lengths on both sides: the thinker writes `--thinker-tokens` tokens (each request's
`max_tokens` with `ignore_eos`: random weights never stop), the talker at most `--frames` codec
frames (ours: `--stage-overrides '{"1": {"default_sampling_params": {"max_tokens": N}}}'`;
vLLM-Omni: its talker stage's `default_sampling_params.max_tokens` in the deploy file). Neither
talker is told to ignore its end-of-speech code: each record counts the answers that reached the
cap (`at_cap`), and the real-time factor divides by the audio actually received.

A run, after the server is healthy (start-up to healthy = `ready_s`): one speech warm-up, then
`--singles` text-only requests one at a time (the thinker's tokens/s), then for each level of
`--levels` (default 1,8,32) that many streamed speech requests at once (level 1: `--singles`
one after another). Memory: the device's used memory before the server starts (baseline) and its
peak while it runs (NVML every 0.2 s; null without an NVIDIA device). Ours also reports its
stage restarts from /metrics. With `--budget-s`, a run starts only if its estimated duration (the
latest run of that system in OUT plus 10%, else `--first-run-s`) fits what is left; runs already
in OUT/results.jsonl are not repeated, so the same command continues in the next call.

`--input audio|video` asks every speech request a media question instead (omni_speech_client's
`user_content`: a 10 s `input_audio` part, or a 30-frame `video_url` part; `audio-new` and
`video-new` send media the server has not seen with each request); its runs are recorded
with `input` and continue only runs of the same input. `--then audio:1,8 --then video:1` measures
more inputs on the same server after the first (one record each, written as each finishes: a
server start is most of a run's time on a fresh GPU machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fair import omni_env, total_gib, used_gib  # noqa: E402
from bench_gpu_glm import PeakMemory, Server, _keep_log_lines, _versions  # noqa: E402
from incumbent import (  # noqa: E402
    QWEN3_OMNI_80GB_FIT,
    QWEN3_OMNI_80GB_SHARES,
    QWEN3_OMNI_TALKER_EXTRA_TOKENS,
    installed_stage_fields,
    qwen3_omni_one_gpu_deploy,
    reserved_share,
    validate_deploy,
)
from omni_speech_client import (  # noqa: E402
    INPUTS,
    Lengths,
    load,
    speech_request,
    stage_counter,
    stage_first_outputs,
    stage_restarts,
    summarize_speech,
    summarize_text,
    text_request,
)

SYSTEMS = ("ours", "omni")
STAGE_CONFIG = "qwen3_omni_1gpu"
TALKER = 1


# ---- what each system serves -----------------------------------------------------------------
def ours_overrides(frames: int, extra: str | None = None) -> dict:
    """Our --stage-overrides: the talker writes exactly `frames` frames (random weights would
    end a sampled answer at random), merged under any `extra` JSON."""
    fixed = {"max_tokens": frames, "min_tokens": frames}
    out: dict = {str(TALKER): {"default_sampling_params": fixed}}
    for sid, over in json.loads(extra or "{}").items():
        merged = {**out.get(sid, {}), **over}
        if "default_sampling_params" in over and "default_sampling_params" in out.get(sid, {}):
            merged["default_sampling_params"] = {
                **out[sid]["default_sampling_params"],
                **over["default_sampling_params"],
            }
        out[sid] = merged
    return out


def ours_reserved(overrides: dict, stage_config: str = STAGE_CONFIG) -> dict:
    from vllm_omni_plugin.config.resolve import load_deploy_config

    cfg = load_deploy_config(stage_config, stage_overrides=json.dumps(overrides))
    stages = [s.flat_dict() for s in cfg.stages]
    caps = {s["stage_id"]: (s.get("default_sampling_params") or {}) for s in stages}
    return {
        "shares": {f"stage_{s['stage_id']}": s.get("gpu_memory_utilization") for s in stages},
        "talker_max_tokens": caps[TALKER].get("max_tokens"),
    }


# GPUs below this much memory (GiB) get the incumbent's 80 GB fit (--omni-fit auto).
FIT_80GB_BELOW_GIB = 100


def incumbent_fit(choice: str, gpu_gib: float | None) -> str:
    """`h200` or `80gb`: `auto` picks by the GPU's memory (h200 when it is unknown)."""
    if choice != "auto":
        return choice
    return "80gb" if gpu_gib is not None and gpu_gib < FIT_80GB_BELOW_GIB else "h200"


def write_incumbent(
    out: Path, omni_path: str | None, src: Path | None, frames: int, fit: str = "h200"
) -> dict:
    """vLLM-Omni's qwen3_omni_moe.yaml (installed under `omni_path`, or `src`) moved to one GPU
    and capped (incumbent.qwen3_omni_one_gpu_deploy), for an H200 or (`fit` "80gb") an 80 GB
    GPU, validated, written to OUT."""
    import yaml

    if src is None:
        src = Path(omni_path or "") / "vllm_omni" / "deploy" / "qwen3_omni_moe.yaml"
    shipped = yaml.safe_load(src.read_text())
    if fit == "80gb":
        cfg, changes = qwen3_omni_one_gpu_deploy(
            shipped, frames, QWEN3_OMNI_80GB_SHARES, QWEN3_OMNI_80GB_FIT
        )
    else:
        cfg, changes = qwen3_omni_one_gpu_deploy(shipped, frames)
    fields = installed_stage_fields(omni_path)
    problems = validate_deploy(cfg, fields)
    if problems:
        raise ValueError(f"incumbent deploy invalid: {problems}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "omni_qwen3_omni_1gpu.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return {
        "deploy": str(path),
        "source": str(src),
        "changes": [c.__dict__ for c in changes],
        "fit": fit,
        "validated_against": "installed vLLM-Omni" if fields else "KNOWN_STAGE_FIELDS",
        "reserved": {"shares": reserved_share(cfg)},
    }


def server_argv(args, system: str, incumbent: dict) -> tuple[list[str], dict, dict]:
    """argv, extra env, and what the system's configuration reserves and caps."""
    if system == "ours":
        overrides = ours_overrides(args.frames, args.stage_overrides)
        argv = [str(args.model), "--stage-config", args.stage_config]
        argv += ["--stage-overrides", json.dumps(overrides)]
        return argv, {}, ours_reserved(overrides, args.stage_config)
    argv = [str(args.model), "--omni", "--deploy-config", incumbent["deploy"]]
    reserved = dict(
        incumbent["reserved"], talker_max_tokens=args.frames + QWEN3_OMNI_TALKER_EXTRA_TOKENS
    )
    return argv, omni_env(args), reserved


# ---- one served run --------------------------------------------------------------------------
async def measure(
    url: str,
    model: str,
    lengths: Lengths,
    singles: int,
    levels: list[int],
    api_key: str = "none",
    media: str = "text",
) -> dict:
    """Everything a run measures once its server is healthy (the module docstring's order)."""
    import httpx
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=1800, max_retries=0)

    async def metrics() -> str:
        try:
            async with httpx.AsyncClient() as http:
                return (await http.get(f"{url}/metrics", timeout=30)).text
        except httpx.HTTPError:  # no /metrics: its figures are missing, the run goes on
            return ""

    async def restarts() -> int | None:
        return stage_restarts(await metrics())

    out: dict = {"restarts_before": await restarts()}
    t0 = time.perf_counter()

    def speak(i: int):
        return speech_request(client, model, i, lengths, media=media)

    warm = await speak(99)
    out["warmup_s"] = round(time.perf_counter() - t0, 2)
    out["warmup_ok"] = warm["ok"]
    text = [await text_request(client, model, i, lengths) for i in range(singles)]
    out["text_c1"] = summarize_text(text)
    print(f"  text c1 {out['text_c1']}", flush=True)
    for level in levels:
        scrape_before = await metrics()
        busy_before = stage_counter(scrape_before, "busy_seconds")
        first_before = stage_first_outputs(scrape_before)
        if level == 1:
            records, wall = [], 0.0
            for i in range(singles):
                rec = await speak(i)
                records.append(rec)
                wall += rec["s"]
        else:
            records, wall = await load(speak, level, level)
        out[f"speech_c{level}"] = summarize_speech(records, wall, level)
        scrape_after = await metrics()
        busy_after = stage_counter(scrape_after, "busy_seconds")
        first_after = stage_first_outputs(scrape_after)
        if first_before is not None and first_after is not None:
            # ours: each streamed stage's mean time from receiving a request to its first
            # chunk (the stages of a request are submitted together: where the first audio's
            # time goes)
            means = out[f"speech_c{level}"]["stage_first_output_s"] = {}
            for k, (total, n) in first_after.items():
                total_before, n_before = first_before.get(k, (0.0, 0.0))
                if n > n_before:
                    means[k] = round((total - total_before) / (n - n_before), 4)
        if busy_before is not None and busy_after is not None:
            # ours: the request-seconds each stage spent on the load's requests (summed over
            # requests, overlapping ones included: a streamed request is in every stage for
            # most of its life, so this says where requests waited, not which stage computed)
            out[f"speech_c{level}"]["stage_request_s"] = {
                k: round(v - busy_before.get(k, 0.0), 3) for k, v in busy_after.items()
            }
        print(f"  speech c{level} {out[f'speech_c{level}']}", flush=True)
    after = await restarts()
    out["restarts_after"] = after
    out["stage_restarts"] = None if after is None else after - (out["restarts_before"] or 0)
    out["http_5xx"] = sum(
        v.get("http_5xx", 0) for k, v in out.items() if k.startswith(("speech_", "text_"))
    )
    await client.close()
    return out


def run_served(args, system: str, incumbent: dict, r: int, record) -> None:
    """Start `system`'s server, measure `args.input` at `args.levels`, then each `--then` input
    on the same server; `record(data)` is called after each, so a call cut short keeps what it
    finished."""
    argv, env, reserved = server_argv(args, system, incumbent)
    baseline = used_gib()
    log = args.out / f"{system}_r{r}.log"
    server = Server(argv, log, env=env)
    try:
        with PeakMemory() as mem:
            ready = server.wait_ready(args.start_timeout)
            print(f"{system} r{r}: ready in {ready:.1f} s", flush=True)
            for i, (media, levels) in enumerate([(args.input, args.levels), *args.then]):
                t0 = time.perf_counter()
                data = asyncio.run(
                    measure(
                        server.url,
                        str(args.model),
                        args.lengths,
                        args.singles,
                        levels,
                        media=media,
                    )
                )
                record(
                    {
                        "input": media,
                        "levels": levels,
                        # the first input's time includes the server's start; a later one's is
                        # its own measurement on the same server
                        "measure_s": round(time.perf_counter() - t0, 1),
                        "same_server_as": None if i == 0 else args.input,
                        "ready_s": round(ready, 1),
                        **data,
                        "baseline_gib": baseline,
                        "peak_gib": mem.peak_gib,
                        "total_gib": total_gib(),
                        "reserved": reserved,
                    }
                )
    finally:
        server.stop()
        _keep_log_lines(log, args.out / f"{system}_r{r}_log_lines.txt")


# ---- rounds ----------------------------------------------------------------------------------
def done_runs(results: Path, media: str = "text") -> list[dict]:
    """The runs recorded for questions of this input kind."""
    if not results.exists():
        return []
    rows = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    return [x for x in rows if x.get("phase") == "omni-speech" and x.get("input", "text") == media]


def plan(
    systems: list[str], rounds: int, done: list[dict], offset: int = 0
) -> list[tuple[int, str]]:
    """The (round, system) runs still to do, in order: rounds `offset` .. `offset + rounds - 1`,
    each running the systems in the given order (ours, theirs, ours, theirs, ...); runs already
    recorded are left out. An offset continues the rounds of an earlier run."""
    have = {(x["round"], x["system"]) for x in done}
    rows = range(offset, offset + rounds)
    return [(r, s) for r in rows for s in systems if (r, s) not in have]


def estimate_s(system: str, done: list[dict], first_run_s: float) -> float:
    """How long a run of `system` will take: its latest run plus 10% (later starts find warm
    compile caches, so the latest is the better guess), else `first_run_s`."""
    mine = [x["run_s"] for x in done if x["system"] == system and "run_s" in x]
    return round(mine[-1] * 1.1, 1) if mine else first_run_s


def phase_run(args) -> None:
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    incumbent = {}
    if "omni" in systems:
        fit = incumbent_fit(args.omni_fit, total_gib())
        incumbent = write_incumbent(args.out, args.omni_path, args.omni_deploy, args.frames, fit)
        (args.out / "incumbent_qwen3_omni.json").write_text(json.dumps(incumbent, indent=1))
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = args.out / "results.jsonl"
    start = time.monotonic()
    todo = plan(systems, args.rounds, done_runs(results, args.input), args.round_offset)
    for r, system in todo:
        left = args.budget_s - (time.monotonic() - start) if args.budget_s else None
        need = estimate_s(system, done_runs(results, args.input), args.first_run_s)
        if left is not None and need > left:
            print(f"STOPPED: {system} r{r} needs ~{need:.0f} s, {left:.0f} s left; run again "
                  f"to continue ({len(todo) - todo.index((r, system))} runs to go)", flush=True)  # fmt: skip
            return
        t0 = time.perf_counter()

        def record(data: dict, r=r, system=system, t0=t0) -> None:
            row = build_record(system, r, device, args.lengths, time.perf_counter() - t0, data)
            row.update(singles=args.singles, versions=_versions())
            row["started_utc"] = time.strftime(
                "%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - row["run_s"])
            )
            if system == "omni":
                row["changes"] = incumbent["changes"]
            with open(results, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)

        run_served(args, system, incumbent, r, record)
    print("ALL_DONE", flush=True)


CAPS = {
    "ours": "thinker: request max_tokens + ignore_eos; talker: --stage-overrides "
    '{"1": {"default_sampling_params": {"max_tokens": FRAMES, "min_tokens": FRAMES}}}',
    "omni": "thinker: request max_tokens + ignore_eos (its thinker stage takes them); talker: "
    f"stage 1 default_sampling_params.max_tokens = FRAMES + {QWEN3_OMNI_TALKER_EXTRA_TOKENS} in "
    "the deploy file (it voices one frame fewer than its max_tokens)",
}


def build_record(
    system: str, r: int, device: str, lengths: Lengths, run_s: float, data: dict
) -> dict:
    """One results.jsonl line: which run, the fixed lengths and how they were capped, and what
    `run_served` measured."""
    return {
        "phase": "omni-speech",
        "system": system,
        "round": r,
        "device": device,
        "lengths": {
            "thinker_tokens": lengths.thinker_tokens,
            "frames": lengths.frames,
            "audio_s_at_cap": lengths.audio_s,
        },
        "caps": CAPS[system].replace("FRAMES", str(lengths.frames)),
        "run_s": round(run_s, 1),
        **data,
    }


def phase_deploy(args) -> None:
    fit = incumbent_fit(args.omni_fit, total_gib())
    info = write_incumbent(args.out, args.omni_path, args.omni_deploy, args.frames, fit)
    print(json.dumps(info, indent=1))


def then_arg(text: str) -> tuple[str, list[int]]:
    media, _, levels = text.partition(":")
    if media not in INPUTS:
        raise argparse.ArgumentTypeError(f"--then wants INPUT:LEVELS with INPUT in {INPUTS}")
    return media, levels_arg(levels or "1")


def levels_arg(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"levels must be integers >= 1, got {text!r}")
    return levels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["run", "deploy"])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/speech")))
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-offset", type=int, default=0, help="first round's number")
    parser.add_argument("--singles", type=int, default=3, help="requests one at a time")
    parser.add_argument("--levels", type=levels_arg, default=[1, 8, 32])
    parser.add_argument("--thinker-tokens", type=int, default=64)
    parser.add_argument("--input", choices=INPUTS, default="text", help="the question's kind")
    parser.add_argument(
        "--then",
        type=then_arg,
        action="append",
        default=[],
        metavar="INPUT:LEVELS",
        help="after --input, measure this input too on the same server (e.g. audio:1,8)",
    )
    parser.add_argument("--frames", type=int, default=128, help="talker frames (80 ms each)")
    parser.add_argument("--stage-config", default=STAGE_CONFIG, help="ours (a CPU dry run: tiny)")
    parser.add_argument("--stage-overrides", default=None, help="ours: more overrides (JSON)")
    parser.add_argument("--omni-path", default=os.environ.get("OMNI_PYTHONPATH", "/tmp/vomni"))
    parser.add_argument("--omni-deploy", type=Path, default=None, help="shipped yaml to start from")
    parser.add_argument(
        "--omni-fit",
        choices=["auto", "h200", "80gb"],
        default="auto",
        help="vLLM-Omni's memory settings: for an H200 or an 80 GB GPU (auto: by the GPU's memory)",
    )
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--budget-s", type=float, default=None, help="seconds this call may use")
    parser.add_argument("--first-run-s", type=float, default=300, help="estimate, first run")
    args = parser.parse_args()
    args.lengths = Lengths(args.thinker_tokens, args.frames)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "run" and args.model is None:
        parser.error("--model is required")
    {"run": phase_run, "deploy": phase_deploy}[args.phase](args)


if __name__ == "__main__":
    main()
