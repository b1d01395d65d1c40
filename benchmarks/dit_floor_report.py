"""BENCHMARKS.md's step-floor tables, generated from the results files (never copied by hand):
each diffusion family's step floor (dit_floor.py) and, beside it, every served figure the
results files hold for that family (bench_fair.py, bench_step_cache.py and bench_video.py runs,
a video run matched to its family by the served shape), as seconds per
step and as a multiple of the floor, with the family's step goal met or not.

    python benchmarks/dit_floor_report.py                      # print, from benchmarks/results
    python benchmarks/dit_floor_report.py --write BENCHMARKS.md
        # replaces the block between `<!-- dit-floor:begin -->` and `<!-- dit-floor:end -->`
    python benchmarks/dit_floor_report.py --results DIR ...    # other folders

A floor is measured only by a timed run on a GPU (`"timed": true`); a dry run's file gives the
step's FLOPs and the analytic floor at a device's datasheet peak, nothing more. A family with no
timed floor says "not measured". A served figure is a whole request's latency alone (text
encoding, every denoising step, decode), so its time per step (latency / steps) is an upper
bound of the served step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dit_floor_families import FAMILIES  # noqa: E402
from fair_report import LABELS as FAIR_LABELS  # noqa: E402
from fair_report import write_into  # noqa: E402

BEGIN, END = "<!-- dit-floor:begin -->", "<!-- dit-floor:end -->"
RESULTS = Path(__file__).resolve().parent / "results"
NOT_MEASURED = "not measured"
VIDEO_LABELS = {"ours": "vllm-omni-plugin", "omni": "vLLM-Omni 0.26", "diffusers": "diffusers"}


def sources(folder: Path = RESULTS) -> list[Path]:
    """The results files the report reads: floors, fair-harness, step-cache and video runs."""
    return sorted(
        [
            *folder.glob("dit_floor_*.json"),
            *folder.glob("fair_*.jsonl"),
            *folder.glob("step_cache_*.jsonl"),
            *folder.glob("wan_video_*.jsonl"),
        ]
    )


def load(paths: list[Path]) -> tuple[list[dict], list[dict]]:
    """(floor runs, served figures) from `paths`; each record names its file."""
    floors, served = [], []
    for path in paths:
        if path.suffix == ".json":
            rec = json.loads(path.read_text())
            if rec.get("bench") == "dit_floor":
                floors.append({**rec, "file": path.name})
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                served.extend(_served(json.loads(line), path.name))
    return floors, served


def _served(rec: dict, file: str) -> list[dict]:
    """A served figure from one results line: one request alone, uncached, seconds."""
    if rec.get("phase") == "fair" and rec.get("c1_s") is not None:
        return [
            {
                "family": rec["family"],
                "figure": "fair harness, 1 request alone",
                "system": FAIR_LABELS.get(rec["system"], rec["system"]),
                "latency_s": rec["c1_s"],
                "n": len(rec.get("c1_runs_s") or [rec["c1_s"]]),
                "steps": rec["steps"],
                "device": rec.get("device", "-"),
                "file": file,
            }
        ]
    if rec.get("bench") == "step_cache" and "alone_s" in rec:
        uncached = (rec.get("cache") or {}).get("policy") == "none" or rec.get("hook") == "none"
        if not uncached:
            return []
        if rec["system"] == "engine":
            how = [
                "CUDA graphs" if rec.get("cuda_graphs") else "eager",
                "compiled blocks" if rec.get("compile_regional") else "no compile",
            ]
            system = f"vllm-omni-plugin ({', '.join(how)})"
        else:
            system = "diffusers"
        return [
            {
                "family": rec["family"],
                "figure": "step-cache run, uncached, 1 request alone",
                "system": system,
                "latency_s": rec["alone_s"]["median"],
                "n": rec["alone_s"]["n"],
                "steps": rec["steps"],
                "device": rec.get("machine", "-"),
                "file": file,
            }
        ]
    if rec.get("level") == 1 and "median_s" in rec and "error" not in rec:  # bench_video.py
        family = _family_at(rec["size"], rec["frames"], rec["steps"])
        if family is None:
            return []
        return [
            {
                "family": family,
                "figure": "video job, 1 request alone",
                "system": VIDEO_LABELS.get(rec["system"], rec["system"]),
                "latency_s": rec["median_s"],
                "n": rec["n"],
                "steps": rec["steps"],
                "device": rec.get("device", "-"),
                "file": file,
            }
        ]
    return []


def _family_at(size: str, frames: int, steps: int) -> str | None:
    """The family whose deploy file serves this video shape (WIDTHxHEIGHT, frames, steps)."""
    width, height = (int(v) for v in size.split("x"))
    for name, family in FAMILIES.items():
        sh = family.shape()
        if (sh.width, sh.height, sh.frames, sh.steps) == (width, height, frames, steps):
            return name
    return None


def _latest(floors: list[dict], family: str, timed: bool) -> tuple[dict, dict] | None:
    picked = [
        (run, fam)
        for run in floors
        if bool(run.get("timed")) == timed
        for fam in run["families"]
        if fam["family"] == family
    ]
    return max(picked, key=lambda p: p[0]["date"]) if picked else None


def _f(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _shape(family) -> str:
    sh = family.shape()
    frames = f"x{sh.frames} frames" if sh.frames else ""
    return f"{sh.width}x{sh.height}{frames}, {sh.steps} steps"


def floor_table(floors: list[dict]) -> list[str]:
    out = [
        "| family | served shape (deploy file) | rows per step | TFLOP per step "
        "| floor ms per step: ops alone, summed | ops in one CUDA graph ms | analytic ms "
        "| SM MHz / W | step goal | goal at or above the floor | floor file |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, family in FAMILIES.items():
        timed = _latest(floors, name, timed=True)
        any_run = timed or _latest(floors, name, timed=False)
        shape = family.shape()
        rows = family.cfg_rows(shape)
        goal = family.step_goal_ms
        goal_txt = "-" if goal is None else f"<= {goal:.0f} ms"
        tflop = analytic = "-"
        analytic_within = ""
        if any_run is not None:
            run, fam = any_run
            tflop = f"{fam['sums']['tflop']:.1f}"
            peak = (run.get("peak") or {}).get("device", "?")
            analytic_ms = fam["sums"]["analytic_ms"]
            analytic = f"{_f(analytic_ms)} ({peak} datasheet)"
            if goal is not None and analytic_ms is not None:
                analytic_within = f"analytic: {'yes' if analytic_ms <= goal else 'no'}"
        if timed is None:
            out.append(
                f"| {family.title} | {_shape(family)} | {rows} | {tflop} | {NOT_MEASURED} | - "
                f"| {analytic} | - | {goal_txt} | {analytic_within or '-'} "
                f"| {any_run[0]['file'] if any_run else '-'} |"
            )
            continue
        run, fam = timed
        s, clock = fam["sums"], fam.get("clock") or {}
        clock_txt = (
            f"{clock['sm_clock_mhz']:.0f} / {clock['power_w']:.0f}"
            if clock.get("sm_clock_mhz") is not None
            else "-"
        )
        within = "-" if goal is None else ("yes" if s["floor_ms"] <= goal else "no")
        if analytic_within:
            within += f" ({analytic_within})"
        # Every timed run of this family on the same machine: the latest's floor, with the
        # range the runs span beside it.
        same = [
            (r, f)
            for r in floors
            if r.get("timed") and r["machine"] == run["machine"]
            for f in r["families"]
            if f["family"] == name
        ]
        spread = ""
        if len(same) > 1:
            values = [f["sums"]["floor_ms"] for _, f in same]
            spread = f"; {min(values):.1f}-{max(values):.1f} over {len(values)} runs"
        files = ", ".join(sorted({r["file"] for r, _ in same}, reverse=True))
        out.append(
            f"| {family.title} | {_shape(family)} | {rows} | {tflop} | **{s['floor_ms']:.1f}** "
            f"({run['machine']}{spread}) | {_f(s.get('sequence_graph_ms'))} | {analytic} "
            f"| {clock_txt} | {goal_txt} | {within} | {files} |"
        )
    return out


def served_table(floors: list[dict], served: list[dict]) -> list[str]:
    out = [
        "| family | served figure | system | device | s per request (median, requests) | steps "
        "| ms per step (request / steps) | floor ms | x floor | x analytic | step goal met "
        "| results file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, family in FAMILIES.items():
        timed = _latest(floors, name, timed=True)
        any_run = timed or _latest(floors, name, timed=False)
        floor_ms = timed[1]["sums"]["floor_ms"] if timed else None
        floor_on = timed[0]["machine"] if timed else None
        analytic_ms = any_run[1]["sums"]["analytic_ms"] if any_run else None
        mine = [r for r in served if r["family"] == name]
        if not mine:
            out.append(
                f"| {family.title} | {NOT_MEASURED} (no served results file) | | | | | "
                f"| {_f(floor_ms) if floor_ms else NOT_MEASURED} | | | | |"
            )
            continue
        groups: dict[tuple, list[dict]] = {}
        for r in mine:
            groups.setdefault((r["figure"], r["system"], r["file"]), []).append(r)
        for (figure, system, file), runs in groups.items():
            latency = statistics.median(r["latency_s"] for r in runs)
            n = sum(r["n"] for r in runs)
            steps = runs[0]["steps"]
            per_step = 1e3 * latency / steps
            goal = family.step_goal_ms
            if goal is None:
                met = "-"
            else:
                met = "met" if per_step <= goal else f"not met (<= {goal:.0f})"
            out.append(
                f"| {family.title} | {figure} | {system} | {runs[0]['device']} "
                f"| {latency:.2f} (n={n}) | {steps} | {per_step:.1f} "
                f"| {_f(floor_ms) if floor_ms else NOT_MEASURED} "
                f"| {_x(per_step, floor_ms, floor_on, runs[0]['device'])} "
                f"| {_x(per_step, analytic_ms)} | {met} | {file} |"
            )
    return out


def _x(a: float, b: float | None, b_on: str | None = None, a_on: str | None = None) -> str:
    """a / b; said when the two were measured on different devices."""
    if not b:
        return "-"
    other = b_on is not None and a_on is not None and b_on not in a_on and a_on not in b_on
    return f"{a / b:.2f}x" + (f" (floor on {b_on})" if other else "")


def report(floors: list[dict], served: list[dict]) -> str:
    lines = ["Step floors:", "", *floor_table(floors), ""]
    lines += ["Served figures beside the floor:", "", *served_table(floors, served), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, nargs="*", default=None,
                    help="results files (default: benchmarks/results's floor, fair and "
                         "step-cache files)")  # fmt: skip
    ap.add_argument("--write", type=Path, default=None, help="markdown file with the markers")
    args = ap.parse_args(argv)
    text = report(*load(args.results if args.results else sources()))
    if args.write is None:
        print(text)
        return
    write_into(args.write, text, BEGIN, END)


if __name__ == "__main__":
    main()
