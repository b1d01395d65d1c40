"""The fair harness end to end on the tiny Qwen-Image (CPU): `bench_fair.py run` serves ours from a
fresh start, then diffusers (one round: tests/test_fair_harness.py checks that the order rotates
from round to round), reads each response's own stage
split from real responses, runs the closed loop, and fair_report.py turns the results into the
table; ours and diffusers give the same image for the same prompt and seed (tiny model in fp32
on both sides: mean pixel difference < 1 of 255)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from omni_server import REPO


def test_bench_fair_rounds_alternate_and_report(tiny_models, tmp_path):
    out = tmp_path / "fair"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_fair.py"), "run", "--family", "qwen-image",
        "--model", str(tiny_models("qwen-image")), "--out", str(out), "--systems", "ours,diffusers",
        "--rounds", "1", "--singles", "1", "--requests", "4", "--concurrency", "2", "--size", "64",
        "--steps", "2", "--stage-config", "qwen_image_tiny", "--start-timeout", "300",
    ]  # fmt: skip
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["round"], r["system"], r["position"]) for r in rows] == [
        (0, "ours", 0), (0, "diffusers", 1),
    ]  # fmt: skip
    for ours in (r for r in rows if r["system"] == "ours"):
        (split,) = ours["c1_split_s"]  # from the x-omni-stage-timings header of a real response
        assert set(split) == {"stage_0", "decode", "other"} and split["stage_0"] > 0
        assert ours["closed"]["completed"] == 4 and ours["closed"]["concurrency"] == 2
        assert ours["closed"]["p50_s"] <= ours["closed"]["p99_s"]
        assert set(ours["closed"]["split_median_s"]) == {"stage_0", "decode", "other"}
        assert ours["ready_s"] > 0 and ours["warmup_s"] > 0
    for ref in (r for r in rows if r["system"] == "diffusers"):
        assert ref["label"] == "one request at a time"
        assert set(ref["c1_split_s"][0]) == {"text", "denoise", "decode"}
    # Ours ran first, so diffusers compared with ours' image.
    assert rows[1]["ours_vs_diffusers_mean_abs_pixel_diff"]["0"] < 1.0

    table = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fair_report.py"), str(out / "results.jsonl")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "| vllm-omni-plugin |" in table and "(n=1)" in table  # one round
    assert "| diffusers (one request at a time) |" in table
