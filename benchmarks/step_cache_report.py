"""The BENCHMARKS.md tables of `bench_step_cache.py` runs, generated from its results.jsonl (never
copied by hand): one table per results file (one run: speed-ups are against that run's own
uncached row), the engine's settings then diffusers' hooks and cache-dit,
speed-ups against the uncached row of the same system in the same run.

    python benchmarks/step_cache_report.py OUT/flux.jsonl OUT/qwen.jsonl              # markdown
    python benchmarks/step_cache_report.py OUT/*.jsonl --write BENCHMARKS.md           # replace
        # the block between `<!-- step-cache-tables:begin -->` and `<!-- step-cache-tables:end -->`
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BEGIN, END = "<!-- step-cache-tables:begin -->", "<!-- step-cache-tables:end -->"


def load(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("bench") == "step_cache":
                    rows.append({**rec, "run": path.name})
    return rows


def setting(cache: dict) -> str:
    if cache["policy"] == "none":
        return "none (every step)"
    if "interval" in cache:
        return f"{cache['policy']} interval {cache['interval']}"
    return f"{cache['policy']} {cache['threshold']}"


def hook_label(spec: str) -> str:
    policy, _, value = spec.partition(":")
    if policy == "none":
        return "none (every step)"
    if policy == "taylorseer":
        return f"taylorseer interval {value} (lite)"
    if policy == "cache_dit":
        return f"cache-dit DBCache F8B0 {value}"
    return f"{policy} {value}"


def _db(x) -> str:
    if x is None:
        return "-"
    return "identical" if x == float("inf") else f"{x:.1f}"


def _f(x, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def _s(s: dict) -> str:
    if s["n"] == 1:
        return f"{s['median']:.2f} (n=1)"
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}, n={s['n']})"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def engine_table(rows: list[dict]) -> list[str]:
    done = [r for r in rows if "alone_s" in r]
    base = next((r for r in done if r["cache"]["policy"] == "none"), None)
    conc = done[0]["concurrency"] if done else "-"
    out = [
        f"| setting | s/image at c1 (median, min-max, n) | speed-up c1 | images/min at c{conc} "
        f"| speed-up c{conc} | skipped c1 / c{conc} | PSNR dB / SSIM c1 vs uncached "
        f"| PSNR dB mean (min) / SSIM mean c{conc} | batched vs alone PSNR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in done:
        up1 = upn = "-"
        if base is not None:
            up1 = f"{base['alone_s']['median'] / r['alone_s']['median']:.2f}x"
            upn = f"{r['images_per_s'] / base['images_per_s']:.2f}x"
        out.append(
            f"| {setting(r['cache'])} | {_s(r['alone_s'])} | {up1} | {60 * r['images_per_s']:.2f} "
            f"| {upn} | {_pct(r['alone_skipped'])} / {_pct(r['batch_skipped'])} "
            f"| {_db(r['psnr'])} / {_f(r['ssim'])} "
            f"| {_db(r['batch_psnr_mean'])} ({_db(r['batch_psnr_min'])}) / "
            f"{_f(r['batch_ssim_mean'])} | {_db(r['batch_vs_alone_psnr'])} |"
        )
    for r in rows:
        if "not_run" in r:
            out.append(f"| {setting(r['cache'])} | not run ({r['not_run']}) | | | | | | | |")
    return out


def hooks_table(rows: list[dict]) -> list[str]:
    done = [r for r in rows if "alone_s" in r]
    base = next((r for r in done if r["hook"] == "none"), None)
    out = [
        "| diffusers + hook | s/image at c1 (median, min-max, n) | speed-up c1 | skipped "
        "| PSNR dB / SSIM vs diffusers uncached | PSNR dB vs the engine, same setting |",
        "|---|---|---|---|---|---|",
    ]
    for r in done:
        up = "-" if base is None else f"{base['alone_s']['median'] / r['alone_s']['median']:.2f}x"
        out.append(
            f"| {hook_label(r['hook'])} | {_s(r['alone_s'])} | {up} | {_pct(r['alone_skipped'])} "
            f"| {_db(r['psnr'])} / {_f(r['ssim'])} | {_db(r['psnr_vs_engine'])} |"
        )
    for r in rows:
        if "error" in r:
            out.append(f"| {hook_label(r['hook'])} | failed: {r['error'][:120]} | | | | |")
        elif "not_run" in r:
            out.append(f"| {hook_label(r['hook'])} | not run ({r['not_run']}) | | | | |")
    return out


def render(rows: list[dict]) -> str:
    lines: list[str] = []
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == run]
        first = mine[0]
        loaded = {r["system"]: r for r in mine if r.get("event") == "loaded"}
        lines += [
            f"#### {first['family']} (`{run}`): {first['machine']}, "
            f"{first['size']}x{first['size']}, {first['steps']} steps, {first['date']}",
            "",
        ]
        settings = [r for r in mine if r["system"] == "engine" and "event" not in r]
        if settings:
            if "engine" in loaded:
                e = loaded["engine"]
                graphs = (
                    "CUDA graphs on (whole forwards, and single blocks where rows skip blocks)"
                    if e.get("cuda_graphs")
                    else "eager: no CUDA graphs"
                )
                lines += [
                    f"Engine ({graphs}): load {e['load_s']} s, 4-step warm-up {e['warm_up_s']} s.",
                    "",
                ]
            lines += engine_table(settings)
            lines.append("")
        hooks = [r for r in mine if r["system"] == "diffusers" and "event" not in r]
        if hooks:
            load = loaded.get("diffusers", {}).get("load_s", "-")
            lines.append(f"diffusers' own pipeline (load {load} s):")
            lines.append("")
            lines += hooks_table(hooks)
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path, nargs="+")
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    text = render(load(args.results))
    if args.write is None:
        print(text, end="")
        return
    doc = args.write.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{args.write}: no {BEGIN} ... {END} block")
    head, rest = doc.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    args.write.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")


if __name__ == "__main__":
    main()
