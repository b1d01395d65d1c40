"""bench_side_lane.py's report: the table BENCHMARKS.md shows, from a results file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_side_lane  # noqa: E402
from fair_report import write_into  # noqa: E402

RUN = {
    "bench": "side_lane",
    "record": "run",
    "device": "a GPU",
    "versions": {"vllm": "0.26.0"},
    "model": "FLUX",
    "command": "bench_side_lane.py",
    "size": 64,
    "steps": 4,
    "requests": 3,
    "interval_ms": 500,
    "max_batch_size": 2,
}


def _round(mode: str, r: int, images_per_s: float, stall: float) -> dict:
    return {
        "bench": "side_lane",
        "record": "round",
        "mode": mode,
        "round": r,
        "wall_s": 3 / images_per_s,
        "images_per_s": images_per_s,
        "latency_s": 1 / images_per_s,
        "max_stall_ms": stall,
    }


def test_report_gives_each_mode_s_spread_and_on_over_off(tmp_path):
    rows = [RUN, _round("off", 0, 1.0, 40.0), _round("on", 0, 1.5, 2.0)]
    rows += [_round("on", 1, 2.5, 4.0), _round("off", 1, 1.0, 60.0)]
    path = tmp_path / "side_lane_x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = bench_side_lane.report([path])
    lines = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines()}
    assert lines["images per second"].endswith("| 1.0 (1.0-1.0, n=2) | 2.0 (1.5-2.5, n=2) | 2.00 |")
    assert (
        "| 50.0 (40.0-60.0, n=2) | 3.0 (2.0-4.0, n=2) | 0.06 |"
        in lines["longest wait between a request's steps (ms)"]
    )
    doc = tmp_path / "B.md"
    doc.write_text(f"head\n{bench_side_lane.BEGIN}\nold\n{bench_side_lane.END}\ntail\n")
    write_into(doc, text, bench_side_lane.BEGIN, bench_side_lane.END)
    assert "old" not in doc.read_text() and "| 2.00 |" in doc.read_text()
    assert doc.read_text().startswith("head\n") and doc.read_text().endswith("tail\n")


def test_a_run_writes_the_file_its_report_reads(tiny_models, tmp_path, monkeypatch):
    """The bench on the CPU (tiny FLUX, one round of each mode) writes the run record and each
    round to `--out` as the round ends; the report reads that file as it is."""
    out = tmp_path / "side_lane.jsonl"
    argv = [
        "bench_side_lane.py", "--model", str(tiny_models("flux")), "--size", "64",
        "--steps", "2", "--requests", "2", "--interval-ms", "10", "--rounds", "1",
        "--device", "cpu", "--dtype", "float32", "--out", str(out),
    ]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_side_lane.main()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["record"] for r in records] == ["run", "round", "round"]
    assert records[0]["command"].startswith("bench_side_lane.py --model ")
    assert records[0]["device"] == "cpu" and "torch" in records[0]["versions"]
    assert {r["mode"] for r in records[1:]} == {"off", "on"}
    assert all(r["images_per_s"] > 0 for r in records[1:])
    assert "| images per second |" in bench_side_lane.report([out])
    with pytest.raises(SystemExit, match="holds one run"):
        bench_side_lane.main()  # the same file again: refused, not appended to
