"""GLM-Image's AR model served two ways, the same requests and sampling: time per output token
inside our pipeline's AR stage vs stock `vllm serve` of the same AR model.

    python benchmarks/bench_ar_served.py run --model DIR --out OUT [--stage-config glm_image_1gpu]
        [--stage-overrides JSON] [--systems ours,stock] [--rounds 1 --round-offset 0]
        [--requests 8] [--concurrency 8] [--size 1024 --steps 50]
    python benchmarks/bench_ar_served.py report OUT/ar_served.jsonl [--write BENCHMARKS.md]

- **ours**: `vllm serve DIR --stage-config CONFIG`, images through `/v1/images/generations`;
  each response's `x-omni-stage-timings` header carries the AR stage's own time to first token
  and time per output token (`stage_0_ttft`, `stage_0_tpot`: stages/token_clock.py, read from
  its vLLM engine's outputs as they reach the stage).
- **stock**: `vllm serve DIR/vision_language_encoder` with the engine settings our AR stage
  gets from the same stage config (dtype, eager, max_num_seqs, memory, prefix caching, async
  scheduling: `StageConfig.engine_kwargs()`), vLLM's own scheduler, and the grid logits
  processor (`--logits-processors`: our stage builds its engine with it too). Requests go to
  `/v1/completions`, streamed, with the very prompt token ids and SamplingParams our AR stage
  builds for the same image request (its own glue, `GlmImageGlue.prepare`); the time per token
  is measured on the client from the streamed chunks' arrival (the same TokenClock rule).

Each round starts each system fresh (order alternating per round), sends one warm-up request,
then the same `--requests` requests (prompt i, seed 1000 + i) through a closed loop at
concurrency 1 and at `--concurrency`; one JSON line per system, round and concurrency goes to
OUT/ar_served.jsonl. The stock side detokenizes (vLLM's completions API has no switch for it);
ours does not (`detokenize: false` in the stage config): the stock figure carries that work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_glm import PROMPTS, PeakMemory, Server, _versions  # noqa: E402

from vllm_omni_plugin.stages.token_clock import TokenClock  # noqa: E402

SYSTEMS = ("ours", "stock")
RESULTS = "ar_served.jsonl"
BEGIN, END = "<!-- ar-served:begin -->", "<!-- ar-served:end -->"
# Engine arguments of our AR stage that are not stock `vllm serve` flags for this comparison:
# the model and tokenizer are given as paths, the scheduler is the point of the comparison
# (stock runs vLLM's own), the logits processor is named once below.
NOT_STOCK_FLAGS = ("model", "tokenizer", "scheduler_cls", "logits_processors")
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos",
)  # fmt: skip


# ---- the two systems' settings, from our stage config ---------------------------------------
def ar_stage(stage_config: str, stage_overrides: str | None, model: Path):
    """Our AR stage's resolved StageConfig (the `vllm serve MODEL --stage-config` view)."""
    from vllm_omni_plugin.config.resolve import load_deploy_config

    cfg = load_deploy_config(stage_config, model=str(model), stage_overrides=stage_overrides)
    (stage,) = [s for s in cfg.stages if s.kind == "ar"]
    return stage


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + name.replace("_", "-")]
    if isinstance(value, (dict, list)):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def stock_argv(stage, model: Path) -> list[str]:
    """`vllm serve` arguments of the stock AR server: our AR stage's engine settings."""
    from vllm_omni_plugin.models.glm_image import LOGITS_PROCESSOR

    argv = [str(stage.model_path), "--tokenizer", str(stage.tokenizer_path)]
    for name, value in stage.engine_kwargs().items():
        if name not in NOT_STOCK_FLAGS and value is not None:
            argv += _flag(name, value)
    return argv + ["--logits-processors", LOGITS_PROCESSOR]


def stock_env(stage) -> dict[str, str]:
    """The AR stage's environment (e.g. VLLM_CPU_KVCACHE_SPACE), as our stage process gets it;
    our own OMNI_* knobs (e.g. the CPU worker's nice level) mean nothing to stock vLLM."""
    env = {str(k): str(v) for k, v in (stage.env or {}).items()}
    return {k: v for k, v in env.items() if not k.startswith("OMNI_")}


def completion_body(stage, model_name: str, prompt: str, size: int, seed: int) -> dict:
    """The streamed /v1/completions body for one image request: the prompt ids and sampling
    our AR stage builds for it (its glue), the grid spec as vllm_xargs' list form."""
    from vllm_omni_plugin.common.messages import GenerationParams
    from vllm_omni_plugin.families.glm_image.processing import GRID_EXTRA_ARG
    from vllm_omni_plugin.stages.ar_glue import GlmImageGlue

    request = GenerationParams(prompt=prompt, height=size, width=size, seed=seed)
    ids, params = GlmImageGlue(stage).prepare(request)
    body: dict[str, Any] = {"model": model_name, "prompt": ids["prompt_token_ids"]}
    for name in SAMPLING_FIELDS:
        value = getattr(params, name)
        body[name] = list(value) if isinstance(value, (list, set, tuple)) else value
    grid = (params.extra_args or {})[GRID_EXTRA_ARG]
    body["vllm_xargs"] = {
        GRID_EXTRA_ARG: [grid["num_tokens"], grid["num_codes"], grid["eos_token_id"]]
    }
    body.update(stream=True, return_token_ids=True, stream_options={"include_usage": True})
    return body


# ---- one request each ------------------------------------------------------------------------
async def ours_request(client, model: str, size: int, steps: int, i: int) -> dict:
    """One image from our pipeline: the AR stage's ttft / tpot from the response's header."""
    t0 = time.perf_counter()
    raw = await client.images.with_raw_response.generate(
        model=model,
        prompt=PROMPTS[i % len(PROMPTS)],
        size=f"{size}x{size}",
        n=1,
        response_format="b64_json",
        extra_body={"seed": 1000 + i, "num_inference_steps": steps},
    )
    took = time.perf_counter() - t0
    res = raw.parse()
    timings = json.loads(raw.headers["x-omni-stage-timings"])
    return {
        "s": took,
        "ttft_ms": timings["stage_0_ttft"],
        "tpot_ms": timings["stage_0_tpot"],
        "b64": res.data[0].b64_json,
    }


# The body's fields the openai client takes as arguments; the rest go as extra_body.
OPENAI_FIELDS = ("model", "prompt", "stream", "stream_options", "max_tokens", "temperature")
OPENAI_FIELDS += ("top_p", "seed")


async def stock_request(client, body: dict) -> dict:
    """One streamed completion: ttft / tpot from the chunks' arrival on the client."""
    t0 = time.perf_counter()
    clock, tokens = TokenClock(), []
    stream = await client.completions.create(
        **{k: body[k] for k in OPENAI_FIELDS},
        extra_body={k: v for k, v in body.items() if k not in OPENAI_FIELDS},
    )
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += (choice.model_extra or {}).get("token_ids") or []
        clock.saw(len(tokens))
    timing = clock.metrics()
    return {
        "s": time.perf_counter() - t0,
        "ttft_ms": timing["ttft_s"] * 1e3,
        "tpot_ms": timing["tpot_s"] * 1e3,
        "tokens": tokens,
    }


async def closed_loop(send, requests: int, concurrency: int) -> tuple[list[dict], float]:
    """Requests 0..requests-1 through `concurrency` workers; results in request order."""
    pending = iter(range(requests))
    results: dict[int, dict] = {}

    async def worker() -> None:
        for i in pending:
            results[i] = await send(i)

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(min(concurrency, requests))])
    return [results[i] for i in range(requests)], time.perf_counter() - t0


def level_record(system: str, concurrency: int, results: list[dict], wall_s: float) -> dict:
    """One system at one concurrency: per-request figures and their medians."""
    tpot = [round(r["tpot_ms"], 3) for r in results]
    ttft = [round(r["ttft_ms"], 2) for r in results]
    out = {
        "system": system,
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": round(wall_s, 2),
        "tpot_ms": tpot,
        "ttft_ms": ttft,
        "tpot_ms_median": round(statistics.median(tpot), 3),
        "ttft_ms_median": round(statistics.median(ttft), 2),
    }
    if "tokens" in results[0]:
        out["tokens"] = [len(r["tokens"]) for r in results]
    return out


async def measure(system: str, url: str, args, stage, api_key: str = "none") -> list[dict]:
    """A warm-up request, then the same requests at concurrency 1 and args.concurrency."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, timeout=3600, max_retries=0)
    if system == "ours":

        async def send(i: int) -> dict:
            return await ours_request(client, str(args.model), args.size, args.steps, i)
    else:
        name = str(stage.model_path)
        bodies = [
            completion_body(stage, name, PROMPTS[i % len(PROMPTS)], args.size, 1000 + i)
            for i in range(args.requests)
        ]
        warm = completion_body(stage, name, PROMPTS[0], args.size, 999)

        async def send(i: int) -> dict:
            return await stock_request(client, warm if i < 0 else bodies[i])

    await send(-1)  # warm-up (prompt 7, or the stock warm-up body)
    levels = []
    for concurrency in sorted({1, args.concurrency}):
        results, wall = await closed_loop(send, args.requests, concurrency)
        record = level_record(system, concurrency, results, wall)
        record["_results"] = results  # for callers in-process (images, tokens); not written
        levels.append(record)
    return levels


# ---- rounds ----------------------------------------------------------------------------------
def start_server(system: str, args, stage, log: Path) -> Server:
    if system == "ours":
        argv = [str(args.model), "--stage-config", args.stage_config]
        if args.stage_overrides:
            argv += ["--stage-overrides", args.stage_overrides]
        return Server(argv, log)
    return Server(stock_argv(stage, args.model), log, env=stock_env(stage))


def run_system(system: str, args, stage, round_index: int) -> list[dict]:
    """Start `system` fresh, measure it, stop it; append its records to OUT/ar_served.jsonl."""
    log = args.out / f"{system}_round{round_index}.log"
    server = start_server(system, args, stage, log)
    try:
        with PeakMemory() as mem:
            ready = server.wait_ready(args.start_timeout)
            levels = asyncio.run(measure(system, server.url, args, stage))
    finally:
        server.stop()
    device = _device()
    common = {
        "round": round_index,
        "device": device,
        "size": args.size,
        "steps": args.steps if system == "ours" else None,
        "stage_config": args.stage_config,
        "stage_overrides": args.stage_overrides,
        "ready_s": round(ready, 1),
        "peak_gib": mem.peak_gib,
        "versions": _versions(),
    }
    if system == "stock":
        common["argv"] = stock_argv(stage, args.model)
    rows = []
    with open(args.out / RESULTS, "a") as f:
        for level in levels:
            level.pop("_results")
            row = {**common, **level}
            f.write(json.dumps(row) + "\n")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def phase_run(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    stage = ar_stage(args.stage_config, args.stage_overrides, args.model)
    print("stock argv:", stock_argv(stage, args.model), flush=True)
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    unknown = set(args.systems.split(",")) - set(SYSTEMS)
    if unknown or not systems:
        raise SystemExit(f"--systems: {sorted(unknown) or 'none'}; known: {', '.join(SYSTEMS)}")
    for r in range(args.round_offset, args.round_offset + args.rounds):
        order = systems if r % 2 == 0 else systems[::-1]  # alternating: ours first every other
        for system in order:
            run_system(system, args, stage, r)


# ---- the report ------------------------------------------------------------------------------
def _spread(values: list[float], digits: int) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f} (n=1)"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f}, n={len(values)})"


def report(rows: list[dict], devices: tuple[str, ...] = ("NVIDIA H200",)) -> str:
    """Markdown: per device and concurrency, each system's median over rounds of its per-round
    median time per output token (and time to first token), with the spread; `devices` listed
    without rows are printed as not measured."""
    lines = []
    seen = sorted({r["device"] for r in rows})
    for device in [*seen, *[d for d in devices if d not in seen]]:
        mine = [r for r in rows if r["device"] == device]
        sizes = sorted({r["size"] for r in mine})
        what = f"{', '.join(f'{s}x{s}' for s in sizes)}" if sizes else "1024x1024"
        lines += [
            f"#### {device}, {what}",
            "",
            "| concurrency | ours: AR stage tpot ms | stock `vllm serve`: tpot ms "
            "| ours / stock | ours ttft ms | stock ttft ms |",
            "|---|---|---|---|---|---|",
        ]
        for c in sorted({r["concurrency"] for r in mine}) or [1, 8]:
            by = {
                s: [r for r in mine if r["system"] == s and r["concurrency"] == c] for s in SYSTEMS
            }
            tp = {s: [r["tpot_ms_median"] for r in by[s]] for s in SYSTEMS}
            tt = {s: [r["ttft_ms_median"] for r in by[s]] for s in SYSTEMS}
            cell = {s: (_spread(tp[s], 3) if tp[s] else "not measured") for s in SYSTEMS}
            ratio = (
                f"{statistics.median(tp['ours']) / statistics.median(tp['stock']):.3f}"
                if tp["ours"] and tp["stock"]
                else "-"
            )
            ttft = {s: (_spread(tt[s], 1) if tt[s] else "-") for s in SYSTEMS}
            lines.append(
                f"| {c} | {cell['ours']} | {cell['stock']} | {ratio} "
                f"| {ttft['ours']} | {ttft['stock']} |"
            )
        if not mine:
            lines += ["", "Not run yet: `scripts/gpu_check.sh ar-served` (docs/benchmarks.md).", ""]
            continue
        reqs = sorted({r["requests"] for r in mine})
        steps = sorted({r["steps"] for r in mine if r["steps"] is not None})
        lines += [
            "",
            f"Per round: {'/'.join(map(str, reqs))} requests per concurrency after one warm-up; "
            f"ours' images at {'/'.join(map(str, steps)) or '-'} steps. Median over rounds of "
            "each round's median (min-max, n rounds).",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def write_section(path: Path, text: str) -> None:
    """Replace the text between the ar-served markers of `path` (both must be there)."""
    doc = path.read_text()
    head, sep, rest = doc.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{path}: no {BEGIN} ... {END} section")
    path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


def phase_report(args) -> None:
    rows = []
    for path in args.results:
        if path.exists():
            rows += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    text = report(rows)
    if args.write:
        write_section(args.write, text)
    print(text, end="")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="phase", required=True)
    run = sub.add_parser("run")
    run.add_argument("--model", type=Path, required=True)
    run.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/ar-served")))
    run.add_argument("--stage-config", default="glm_image_1gpu")
    run.add_argument("--stage-overrides", default=None)
    run.add_argument(
        "--systems",
        default="ours,stock",
        help="which of ours,stock run in this call (a round split over calls keeps its index)",
    )
    run.add_argument("--rounds", type=int, default=1)
    run.add_argument("--round-offset", type=int, default=0)
    run.add_argument("--requests", type=int, default=8)
    run.add_argument("--concurrency", type=int, default=8)
    run.add_argument("--size", type=int, default=1024)
    run.add_argument("--steps", type=int, default=50, help="ours: the DiT's steps per image")
    run.add_argument("--start-timeout", type=float, default=900)
    rep = sub.add_parser("report")
    rep.add_argument("results", type=Path, nargs="+")
    rep.add_argument("--write", type=Path, help="replace the ar-served section of this file")
    args = parser.parse_args()
    {"run": phase_run, "report": phase_report}[args.phase](args)


if __name__ == "__main__":
    main()
