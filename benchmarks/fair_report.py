"""The BENCHMARKS.md tables of `bench_fair.py` runs, generated from results.jsonl (never copied by
hand): one table per model family, one row per system, each figure the median over its runs
(rounds) with the spread (min-max) beside it.

    python benchmarks/fair_report.py OUT/results.jsonl [MORE.jsonl ...]          # print markdown
    python benchmarks/fair_report.py OUT/results.jsonl --write BENCHMARKS.md     # replace the
        # block between the `<!-- fair-tables:begin -->` and `<!-- fair-tables:end -->` markers
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

BEGIN, END = "<!-- fair-tables:begin -->", "<!-- fair-tables:end -->"
ORDER = ("ours", "omni-tuned", "omni", "diffusers")
LABELS = {
    "ours": "vllm-omni-plugin",
    "omni": "vLLM-Omni 0.26 as shipped",
    "omni-tuned": "vLLM-Omni 0.26 tuned",
    "diffusers": "diffusers (one request at a time)",
}


def load(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec.get("phase") in ("fair", "parity"):
                    rows.append(rec)
    return rows


def _stat(values: list[float]) -> str:
    """`median (min-max, n)`; `-` when there is none."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.2f} (n=1)"
    return f"{med:.2f} ({min(values):.2f}-{max(values):.2f}, n={len(values)})"


def _split(runs: list[dict]) -> str:
    """The median over runs of each run's median concurrency-1 split, seconds."""
    per_key: dict[str, list[float]] = {}
    for run in runs:
        splits = run.get("c1_split_s") or []
        for key in sorted({k for s in splits for k in s}):
            per_key.setdefault(key, []).append(
                statistics.median(s[key] for s in splits if key in s)
            )
    return ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in per_key.items()) or "-"


def _reserved(run: dict) -> str:
    res = run.get("reserved") or {}
    shares = res.get("shares")
    if not shares:
        return res.get("note", "-")
    parts = [f"{k} {v}" if v is not None else f"{k} unset" for k, v in shares.items()]
    gib = f" = {res['gib']} GiB" if "gib" in res else ""
    return ", ".join(parts) + gib


def _throughput(run: dict, key: str) -> float | None:
    if run["system"] == "diffusers":
        return run.get("images_per_min_one_at_a_time") if key == "closed" else None
    return (run.get(key) or {}).get("images_per_min")


def table(rows: list[dict], family: str) -> str:
    parity = [r for r in rows if r["family"] == family and r["phase"] == "parity"]
    runs = [r for r in rows if r["family"] == family and r["phase"] == "fair"]
    if not runs:
        return ""
    first = runs[0]
    closed = next((r["closed"] for r in runs if r.get("closed")), {})
    lines = [
        f"### {family}: {first.get('device', '?')}, {first['size']}x{first['size']}, "
        f"{first['steps']} steps",
        "",
        f"Closed loop: {closed.get('requests', '?')} requests at concurrency "
        f"{closed.get('concurrency', '?')}. Median over runs (min-max, n runs); rounds in "
        "alternating order.",
        "",
        "| system | images/min (closed loop) | p50 s | p99 s | images/min (open loop) | "
        "latency at c1 s | c1 split s | warm-up s | ready s | peak GiB (baseline) | reserved |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for system in ORDER:
        mine = [r for r in runs if r["system"] == system]
        if not mine:
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    LABELS[system],
                    _stat([_throughput(r, "closed") for r in mine]),
                    _stat([(r.get("closed") or {}).get("p50_s") for r in mine]),
                    _stat([(r.get("closed") or {}).get("p99_s") for r in mine]),
                    _stat([_throughput(r, "open") for r in mine]),
                    _stat([r.get("c1_s") for r in mine]),
                    _split(mine),
                    _stat([r.get("warmup_s") for r in mine]),
                    _stat([r.get("ready_s") for r in mine]),
                    f"{_stat([r.get('peak_gib') for r in mine])} "
                    f"({_stat([r.get('baseline_gib') for r in mine])})",
                    _reserved(mine[-1]),
                ]
            )
            + " |"
        )
    changes = next((r.get("changes") for r in runs if r["system"] == "omni-tuned"), None)
    if changes:
        lines += ["", "Tuned incumbent, changed from as shipped:", ""]
        lines += [f"- `{c['where']}`: {c['shipped']} -> {c['tuned']} ({c['why']})" for c in changes]
    diffs = [
        r.get("ours_vs_diffusers_mean_abs_pixel_diff") for r in runs if r["system"] == "diffusers"
    ]
    diffs += [r.get("mean_abs_pixel_diff") for r in parity]
    diffs = [v for d in diffs if d for v in d.values()]
    if diffs:
        lines += [
            "",
            f"Ours vs diffusers, same prompt and seed: mean abs pixel difference "
            f"{_stat(diffs)} (of 255).",
        ]
    return "\n".join(lines) + "\n"


def report(rows: list[dict]) -> str:
    families = sorted({r["family"] for r in rows})
    return "\n".join(table(rows, f) for f in families)


def write_into(doc: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace what lies between the markers `begin` and `end` in `doc` with `text`."""
    content = doc.read_text()
    if begin not in content or end not in content:
        raise ValueError(f"{doc} has no {begin} ... {end} block")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    doc.write_text(f"{head}{begin}\n{text.rstrip()}\n{end}{tail}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+")
    parser.add_argument("--write", type=Path, default=None, help="markdown file with the markers")
    args = parser.parse_args()
    text = report(load(args.results))
    if args.write:
        write_into(args.write, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
