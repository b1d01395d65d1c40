"""`bench_dit_ab.py --qwen-rows` (benchmarks/dit_qwen_rows.py), dry run on the CPU: the tiny
Qwen-Image DiT through the same variants the GPU times (alone, batch 8 masked, batch 8 per
row, the no-padding floor), with true CFG rows, and its JSON and table; and the batch inputs
each variant builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import dit_qwen_rows  # noqa: E402

ALONE, MASKED, PER_ROW, FLOOR = (
    "alone (batch 1, each prompt in turn)",
    "batch 8, masked attention (diffusers)",
    "batch 8, per-row attention",
    "floor: batch 8, all at the longest text, no mask",
)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, str]:
    """The bench as the GPU runs it (--cfg), tiny and on the CPU, one round of one call."""
    out = tmp_path_factory.mktemp("qwen-rows")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks/bench_dit_ab.py"),
        "--qwen-rows",
        "--tiny",
        "--cfg",
        "--rounds",
        "1",
        "--calls",
        "1",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "qwen_rows.json").read_text()), (out / "qwen_rows.md").read_text()


def test_dry_run_writes_every_variant_with_its_attention_path(dry_run):
    result, md = dry_run
    assert result["machine"] == "cpu"
    assert result["software"].startswith(f"torch {torch.__version__}, diffusers ")
    assert "--qwen-rows" in result["command"]
    assert result["text_lengths"] == list(dit_qwen_rows.TINY_LENGTHS)
    assert result["rows_per_batch"] == 16 and result["cfg"]
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == [ALONE, MASKED, PER_ROW, FLOOR]
    for r in rows.values():
        assert r["median_ms"] > 0 and r["per_image_ms"] == pytest.approx(r["median_ms"] / 8)
        assert r["vs_alone"] == pytest.approx(r["per_image_ms"] / rows[ALONE]["per_image_ms"])
    # Two warm calls of a 2-block DiT: the per-row variant attended per row in every block, the
    # masked one never did; alone, each prompt's cond and uncond rows (two lengths) per row.
    assert rows[PER_ROW]["attention_calls"] == {"per_row": 4, "masked": 0}
    assert rows[MASKED]["attention_calls"] == {"per_row": 0, "masked": 0}
    assert rows[ALONE]["attention_calls"] == {"per_row": 8 * 4, "masked": 0}
    # fp32: both batched variants give each prompt's alone prediction.
    assert rows[PER_ROW]["rel_err_vs_alone"] < 1e-5
    assert rows[MASKED]["rel_err_vs_alone"] < 1e-5
    assert f"| {PER_ROW} |" in md and "vs alone" in md


def test_batch_inputs_of_each_variant():
    tr = dit_qwen_rows.transformer(torch.device("cpu"), torch.float32, tiny=True)
    rows = dit_qwen_rows.rows_inputs(tr, [3, 7, 5], 64, "cpu", torch.float32)
    per_row = dit_qwen_rows.call_kwargs(rows, 64, "per_row")
    masked = dit_qwen_rows.call_kwargs(rows, 64, "masked")
    floor = dit_qwen_rows.call_kwargs(rows, 64, "floor")
    assert per_row["attention_kwargs"] == {"text_lengths": (3, 7, 5)}
    assert masked["attention_kwargs"] == {} and floor["attention_kwargs"] == {}
    assert per_row["encoder_hidden_states_mask"].sum(dim=1).tolist() == [3, 7, 5]
    assert torch.equal(per_row["encoder_hidden_states"], masked["encoder_hidden_states"])
    assert per_row["encoder_hidden_states"][0, 3:].abs().sum() == 0  # right-padded with zeros
    assert floor["encoder_hidden_states_mask"] is None
    assert floor["encoder_hidden_states"][0].abs().sum(dim=1).min() > 0  # no padding
    one = dit_qwen_rows.call_kwargs(rows[:1], 64, "per_row")
    assert one["encoder_hidden_states_mask"] is None and one["attention_kwargs"] == {}
    assert one["encoder_hidden_states"].shape[1] == 3


def test_report_tables_each_results_file(dry_run, tmp_path):
    result, md = dry_run
    path = tmp_path / "qwen_rows_cpu.json"
    path.write_text(json.dumps(result))
    text = dit_qwen_rows.report([path])
    assert text.startswith("From `qwen_rows_cpu.json`:") and md in text
    doc = tmp_path / "doc.md"
    doc.write_text(f"head\n{dit_qwen_rows.BEGIN}\nold\n{dit_qwen_rows.END}\ntail\n")
    from fair_report import write_into

    write_into(doc, text, dit_qwen_rows.BEGIN, dit_qwen_rows.END)
    assert "old" not in doc.read_text() and md in doc.read_text()


def test_benchmarks_md_rows_block_is_the_report_of_the_results_files():
    doc = (ROOT / "BENCHMARKS.md").read_text()
    block = doc.split(dit_qwen_rows.BEGIN, 1)[1].split(dit_qwen_rows.END, 1)[0]
    files = sorted((ROOT / "benchmarks" / "results").glob("qwen_rows_*.json"))
    assert files, "no per-row batching results file"
    assert block.strip() == dit_qwen_rows.report(files).strip()
