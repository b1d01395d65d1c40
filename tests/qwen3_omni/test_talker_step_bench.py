"""benchmarks/bench_talker_step.py's vLLM mode, dry run on the CPU: the tiny checkpoint stepped by
vLLM's engine at small batches, its JSON, and the bandwidth floor against a hand count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BATCHES, FRAMES = (1, 4), 6


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    """The bench as the GPU runs it, on the tiny checkpoint, but eager (`--eager`): nothing here
    checks the compiled talker, which vLLM's CPU build compiles with inductor (~30 s alone,
    against ~34 s compiled; most of it one vLLM CPU engine's start and first steps)."""
    tmp = tmp_path_factory.mktemp("talker-step")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks/bench_talker_step.py"),
        "--device",
        "cpu",
        "--tiny",
        "--work",
        str(tmp / "model"),
        "--out",
        str(tmp / "out"),
        "--batches",
        ",".join(map(str, BATCHES)),
        "--frames",
        str(FRAMES),
        "--profile",
        "2",
        "--eager",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp / "out/talker_step.json").read_text())


def _hand_count_bytes(batch: int) -> float:
    """The tiny talker (testing/tiny_qwen3_omni.py), counted by hand, float32 (4 bytes):
    hidden 64, 2 heads x 32 (64 query), 1 kv head (32), 2 layers, 4 experts (top 2) of width 32,
    shared expert 32; codec vocab 1088; code predictor: 1 layer, hidden 64, 2 x 32 heads, 1 kv
    head, MLP 64, 4 code groups (3 sub-steps), codebook 64; thinker hidden 64."""
    attention = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 32 + 32  # q k v o, q/k norms
    norms = 64 + 64
    moe_dense = 4 * 64 + 3 * 32 * 64 + 64  # router, shared expert, its gate
    talker_layers = 2 * (attention + norms + moe_dense)
    final_norm = 64
    codec_head = 1088 * 64
    text_projection = (64 * 64 + 64) * 2  # fc1, fc2 with biases
    dense = talker_layers + final_norm + codec_head + text_projection
    predictor_pass = attention + norms + 3 * 64 * 64 + 64  # its one layer and final norm
    predictor = 3 * predictor_pass + 3 * 64 * 64  # 3 sub-steps; each reads its own head
    experts = 4 * (1 - (1 - 2 / 4) ** batch)  # distinct experts per layer, expected
    routed = 2 * experts * 3 * 32 * 64
    rows = batch * (64 + 3 * 64 + 64)  # codec row, 3 predictor rows, thinker row
    return 4 * (dense + predictor + routed + rows)


def test_dry_run_json_and_floor(dry_run):
    """Every (sampling, batch) row ran its frames; the floor equals the hand count."""
    assert dry_run["engine"] == "vllm" and dry_run["dtype"] == "float32"
    assert dry_run["hbm_bytes_per_s"] == 4.8e12
    rows = {(r["sampling"], r["batch"]): r for r in dry_run["talker_vllm"]}
    assert set(rows) == {(s, b) for s in ("greedy", "checkpoint") for b in BATCHES}
    for (_, batch), row in rows.items():
        assert row["frames_made"] == [FRAMES]  # the end code never stopped a request
        # The prefill samples the first frame; later requests of a batch may join a step late.
        assert FRAMES <= row["steps"] <= FRAMES + 2
        assert FRAMES - 3 <= row["decode_steps_timed"] <= FRAMES - 1
        assert 0 < row["step_ms_p90"] and 0 < row["step_ms"] <= row["step_ms_p90"]
        expected = _hand_count_bytes(batch)
        assert row["weight_bytes"]["total"] == pytest.approx(expected, abs=1)
        assert row["floor_ms"] == pytest.approx(expected / 4.8e12 * 1000, abs=1e-4)
        assert row["step_over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"], 0.01)
        assert row["floor_with_kv_ms"] > row["floor_ms"]


def test_report_table(dry_run, tmp_path):
    """The `report` subcommand writes the rows between the talker-step markers."""
    result = tmp_path / "talker_step_cpu.json"
    result.write_text(json.dumps(dry_run))
    doc = tmp_path / "B.md"
    doc.write_text("x\n<!-- talker-step:begin -->\nold\n<!-- talker-step:end -->\ny\n")
    cmd = [sys.executable, str(ROOT / "benchmarks/bench_talker_step.py"), "report"]
    subprocess.run([*cmd, str(result), "--write", str(doc)], check=True, timeout=60)
    text = doc.read_text()
    assert "old" not in text and text.startswith("x\n") and text.endswith("y\n")
    rows = [line for line in text.splitlines() if line.endswith("| talker_step_cpu.json |")]
    assert len(rows) == len(dry_run["talker_vllm"])
    greedy_1 = next(
        r for r in dry_run["talker_vllm"] if (r["sampling"], r["batch"]) == ("greedy", 1)
    )
    assert f"| greedy | 1 | {FRAMES} | {greedy_1['step_ms']} |" in rows[0]


def test_report_floors_each_file_at_its_devices_bandwidth(dry_run):
    """A run on an H100 is floored at its 3.35 TB/s, whatever bandwidth the file recorded."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_talker_step

    run = json.loads(json.dumps(dry_run))
    run["device"] = "NVIDIA H100 80GB HBM3"
    row = run["talker_vllm"][0]
    floor = row["weight_bytes"]["total"] / 3.35e12 * 1000
    text = bench_talker_step.vllm_table([(Path("h100.json"), run)])
    line = next(x for x in text.splitlines() if x.endswith("| h100.json |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert float(cells[5]) == pytest.approx(floor, rel=1e-3)
    assert float(cells[6]) == pytest.approx(row["step_ms"] / floor, rel=1e-2)


def test_profile_of_a_batch(dry_run):
    """`--profile 2`: the engine ran in this process and 20 decode steps at batch 2 were profiled
    (no GPU here: no kernels, the top ops by CPU time)."""
    assert dry_run["engine_in_process"] is True
    prof = dry_run["profile"]
    assert prof["batch"] == 2 and prof["steps"] == 20 and prof["step_wall_ms"] > 0
    assert prof["kernels_per_step"] == 0 and prof["gpu_busy_ms_per_step"] == 0
    assert "Self CPU" in prof["top_ops"] and "aten::" in prof["top_ops"]


def test_gpu_busy_time_is_the_union_of_kernel_intervals():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from talker_step_vllm import _merged_us

    assert _merged_us([]) == 0
    assert _merged_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
