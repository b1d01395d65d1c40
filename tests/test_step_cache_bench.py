"""bench_step_cache.py's parts that need no GPU: setting specs, the image distances, and the
BENCHMARKS.md tables step_cache_report.py generates from a run's results.jsonl (speed-ups
recomputed from the recorded medians, exact to the printed two decimals)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_step_cache  # noqa: E402
import step_cache_report  # noqa: E402

FLUX = REPO / "benchmarks" / "results" / "step_cache_flux_h200_2026-12-03.jsonl"


@pytest.mark.parametrize(
    ("spec", "cache"),
    [
        ("none", {"policy": "none"}),
        ("first_block:0.08", {"policy": "first_block", "threshold": 0.08}),
        ("teacache:0.4", {"policy": "teacache", "threshold": 0.4}),
        ("taylorseer:3", {"policy": "taylorseer", "interval": 3}),
    ],
)
def test_parse_row(spec, cache):
    assert bench_step_cache.parse_row(spec) == cache


def test_distances():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 255, (16, 16, 3))
    assert bench_step_cache.psnr(a, a) == float("inf")
    assert bench_step_cache.ssim(a, a) == pytest.approx(1.0)
    b = a + 1.0  # mse 1: 20*log10(255)
    assert bench_step_cache.psnr(a, b) == pytest.approx(48.1308, abs=1e-3)
    assert bench_step_cache.ssim(a, 255 - a) < 0


def test_report_speedups_from_recorded_medians(tmp_path):
    rows = step_cache_report.load([FLUX])
    engine = [r for r in rows if r["system"] == "engine" and "alone_s" in r]
    base = next(r for r in engine if r["cache"]["policy"] == "none")
    text = step_cache_report.render(rows)
    for r in engine:
        up1 = base["alone_s"]["median"] / r["alone_s"]["median"]
        up8 = r["images_per_s"] / base["images_per_s"]
        line = next(
            ln
            for ln in text.splitlines()
            if ln.startswith(f"| {step_cache_report.setting(r['cache'])} |")
        )
        assert f"| {up1:.2f}x |" in line and f"| {up8:.2f}x |" in line
    assert "not run (budget)" in text  # settings a budget cut are listed, not dropped


def test_report_write_replaces_only_the_block(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text(f"head\n{step_cache_report.BEGIN}\nold\n{step_cache_report.END}\ntail\n")
    results = tmp_path / "r.jsonl"
    rec = json.loads(FLUX.read_text().splitlines()[1])
    results.write_text(json.dumps(rec) + "\n")
    sys.argv = ["step_cache_report.py", str(results), "--write", str(doc)]
    step_cache_report.main()
    once = doc.read_text()
    step_cache_report.main()
    assert doc.read_text() == once
    assert once.startswith("head\n") and once.endswith("tail\n") and "old" not in once
    assert "none (every step)" in once


def test_glm_image_rows_run_on_random_ar_tokens(
    tiny_models, tmp_path, monkeypatch, one_torch_thread
):
    """The GLM-Image path the H200 run takes (scripts/gpu_step_cache.sh glm), on the tiny build:
    the engine and diffusers paint the same random AR tokens (uncached images within 60 dB: float
    rounding of one fp32 CPU run), taylorseer interval 3 skips 2 of every 3 steps past the first
    of its window (1/3 of 6 here), and diffusers' hooks that do not register GLM-Image's blocks are
    recorded as errors, not dropped."""
    model = tiny_models("glm-image")
    argv = ["bench_step_cache.py", "--model", str(model), "--family", "glm-image", "--size", "64",
            "--steps", "6", "--concurrency", "2", "--repeats", "1", "--device", "cpu", "--dtype",
            "float32", "--rows", "none", "taylorseer:3", "--diffusers", "--hooks", "none",
            "first_block:0.08", "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    bench_step_cache.main()
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    engine = {r["cache"]["policy"]: r for r in rows if r["system"] == "engine" and "cache" in r}
    assert engine["none"]["errors"] == [] and engine["taylorseer"]["errors"] == []
    assert engine["taylorseer"]["alone_skipped"] == pytest.approx(1 / 3, abs=1e-3)
    assert engine["none"]["batch_vs_alone_psnr"] >= 60
    hooks = {r["hook"]: r for r in rows if r["system"] == "diffusers" and "hook" in r}
    assert hooks["none"]["psnr_vs_engine"] >= 60
    assert "not registered" in hooks["first_block:0.08"]["error"]
