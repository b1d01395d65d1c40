"""dit_floor.py's parts that need no GPU: each family's step op list, recorded on its full-size
transformer (fake tensors) at the served shape, must use every Linear layer once per block and
match the shapes the deploy files serve; the timing and summing code runs on small CPU ops; the
dry run writes its results file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import dit_floor  # noqa: E402
from dit_floor_families import FAMILIES  # noqa: E402
from dit_floor_ops import Op, analytic_ms, grouped  # noqa: E402


@pytest.fixture(scope="module")
def found() -> dict:
    return {}


def _found(cache: dict, name: str) -> dict:
    if name not in cache:
        cache[name] = dit_floor.enumerate_family(FAMILIES[name])
    return cache[name]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_step_uses_every_linear_of_every_block(found, name):
    """Each distinct weight the recorded GEMMs use, summed, is the transformer's Linear weight
    count; within the blocks, each block's Linear parameters x blocks."""
    f = _found(found, name)
    cov = f["coverage"]
    assert cov["uncalled"] == []
    assert cov["weight_elements_used"] == cov["linear_weight_elements"]
    blocks = FAMILIES[name].blocks(f["model"])
    assert len(blocks) == cov["blocks"] > 1
    in_blocks = {
        id(m.weight): m.weight.numel()
        for b in blocks
        for m in b.modules()
        if isinstance(m, torch.nn.Linear)
    }
    used = [id(w) for w in f["weights"] if id(w) in in_blocks]
    # every block linear called (GLM-Image's feed-forward runs twice: image, then glyph tokens)
    assert set(used) == set(in_blocks)
    per_kind: dict[type, int] = {}
    for b in blocks:
        n = sum(m.weight.numel() for m in b.modules() if isinstance(m, torch.nn.Linear))
        assert per_kind.setdefault(type(b), n) == n  # blocks of one kind are alike
    kinds = [type(b) for b in blocks]
    assert sum(per_kind[k] * kinds.count(k) for k in per_kind) == sum(
        in_blocks[i] for i in set(used)
    )
    assert sum(op.kind == "sdpa" for op in f["ops"]) >= len(blocks)  # attention in every block


def test_flux_matches_the_published_step_count_and_flops(found):
    """FLUX.1-dev at 1024x1024: 19 double + 38 single blocks, 57 joint attention calls over
    4096 image + 512 text tokens; 74.4 TFLOP, as the DiT step tables count it."""
    from dit_timing import dit_flops

    f = _found(found, "flux")
    attn = [op for op in f["ops"] if op.kind == "sdpa"]
    assert len(attn) == 57 and {(op.q_len, op.kv_len, op.heads) for op in attn} == {
        (4608, 4608, 24)
    }
    tflop = sum(op.flops for op in f["ops"]) / 1e12
    assert tflop == pytest.approx(dit_flops(57, 3072, 4608) / 1e12, rel=0.01)
    assert f["shape"].steps == 28 and f["cfg_rows"] == 1


@pytest.mark.parametrize(
    ("name", "size", "rows", "tokens"),
    [
        ("qwen-image", (1024, 1024, None), 1, 4096 + 16),
        ("glm-image", (1024, 1024, None), 2, 4096 + 1),
        # 121 frames -> 31 latent frames; 704/16/2 x 1280/16/2 = 22 x 40 tokens each
        ("wan2.2-ti2v-5b", (704, 1280, 121), 2, 31 * 22 * 40),
        # 81 frames -> 21 latent frames; 480/8/2 x 832/8/2 = 30 x 52
        ("wan2.2-t2v-a14b", (480, 832, 81), 2, 21 * 30 * 52),
    ],
)
def test_served_shapes_come_from_the_deploy_files(found, name, size, rows, tokens):
    f = _found(found, name)
    sh = f["shape"]
    assert (sh.height, sh.width, sh.frames) == size
    assert f["cfg_rows"] == rows
    self_attn = max((op for op in f["ops"] if op.kind == "sdpa"), key=lambda op: op.q_len)
    assert (self_attn.batch, self_attn.q_len, self_attn.kv_len) == (rows, tokens, tokens)


def test_timing_and_sums_on_small_cpu_ops(found):
    """time_op / time_sequence / family_record on CPU-sized ops: the floor is count x median
    summed over the distinct ops, the analytic floor the roofline of each."""
    ops = [
        Op("linear", m=8, k=16, n=32, bias=True),
        Op("sdpa", batch=2, heads=2, q_len=8, kv_len=8, head_dim=4, mask_shape=(2, 1, 1, 8)),
        Op("linear", m=8, k=16, n=32, bias=True),
        Op("sdpa", batch=1, heads=2, q_len=8, kv_len=4, head_dim=4),
    ]
    cpu = torch.device("cpu")
    timings = {op: dit_floor.time_op(op, cpu, warmup=1, iters=3) for op, _ in grouped(ops)}
    assert all(t["median_ms"] > 0 and t["reps"] >= 1 for t in timings.values())
    seq = dit_floor.time_sequence(ops, cpu, iters=2)
    assert seq["median_ms"] > 0
    base = _found(found, "flux")
    fake = {**base, "ops": ops}
    peak = ("H200", (989.4e12, 4.8e12))
    rec = dit_floor.family_record(fake, peak, timings, seq)
    want = sum(c * timings[op]["median_ms"] for op, c in grouped(ops))
    assert rec["sums"]["floor_ms"] == pytest.approx(want)
    assert rec["sums"]["analytic_ms"] == pytest.approx(sum(analytic_ms(op, peak[1]) for op in ops))
    assert [r["count"] for r in rec["ops"]] == [2, 1, 1]
    assert rec["ops"][1]["mask_shape"] == [2, 1, 1, 8]
    assert rec["sums"]["sequence_graph_ms"] == seq["median_ms"]


def test_dry_run_writes_the_op_list_without_timings(tmp_path):
    result = dit_floor.main(
        ["--dry-run", "--families", "glm-image", "--peak", "H100", "--out", str(tmp_path)]
    )
    saved = json.loads((tmp_path / "dit_floor.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["timed"] is False and saved["peak"]["device"] == "H100"
    (fam,) = saved["families"]
    assert fam["family"] == "glm-image" and fam["step_goal_ms"] == 110.0
    assert fam["sums"]["floor_ms"] is None and fam["sums"]["analytic_ms"] > 100
    assert sum(r["count"] for r in fam["ops"]) == (
        fam["sums"]["linear_calls"] + fam["sums"]["sdpa_calls"]
    )
    assert "GLM-Image DiT: 1024x1024, 2 row(s) per step" in (tmp_path / "dit_floor.md").read_text()


def test_unknown_family_is_refused():
    with pytest.raises(SystemExit):
        dit_floor.main(["--dry-run", "--families", "flux,sdxl"])


def test_coverage_names_a_linear_the_step_never_calls():
    """A layer the forward skips (or reaches other than through F.linear) is reported, and
    dit_floor refuses to time a floor without it."""
    from dit_floor_ops import linear_coverage, record_ops

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.skipped = torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)

        def forward(self, x):
            return torch.addmm(self.skipped.bias, self.used(x), self.skipped.weight.t())

    model = Model()
    rec = record_ops(lambda: model(torch.zeros(2, 4)))
    cov = linear_coverage(model, rec)
    assert cov["uncalled"] == ["skipped"]
    assert cov["weight_elements_used"] == 16 and cov["linear_weight_elements"] == 48
    with pytest.raises(dit_floor.MissedLayers, match="skipped"):
        dit_floor.check_coverage({"family": FAMILIES["flux"], "coverage": cov})


# ---- the report ------------------------------------------------------------------------------
def test_benchmarks_md_floor_block_is_the_report_of_the_results_files():
    """BENCHMARKS.md's dit-floor block is what dit_floor_report.py makes of benchmarks/results
    (regenerated and compared as text): no hand-edited figure, and a family without a timed
    floor file says "not measured"."""
    import dit_floor_report

    doc = (REPO / "BENCHMARKS.md").read_text()
    block = doc.split(dit_floor_report.BEGIN, 1)[1].split(dit_floor_report.END, 1)[0]
    text = dit_floor_report.report(*dit_floor_report.load(dit_floor_report.sources()))
    assert block.strip() == text.strip()
    floors, _ = dit_floor_report.load(dit_floor_report.sources())
    if not any(run["timed"] for run in floors):
        assert text.count(dit_floor_report.NOT_MEASURED) >= len(FAMILIES)


def test_a_timed_floor_sits_beside_the_served_figures(found, tmp_path):
    """A timed floor file puts its floor in the family's rows: served ms per step over the
    floor, the step goal within the floor or not, the device named when the two differ; the
    families it lacks stay "not measured"."""
    import dit_floor_report

    f = _found(found, "flux")
    timings = {op: {"median_ms": 0.25, "min_ms": 0.2, "reps": 4} for op, _ in grouped(f["ops"])}
    rec = dit_floor.family_record(f, ("H100", (989.4e12, 3.35e12)), timings, None)
    rec["clock"] = {"sm_clock_mhz": 1755.0, "power_w": 690.0, "temp_c": 60.0, "samples": 9}
    run = {"bench": "dit_floor", "machine": "NVIDIA H100 80GB HBM3", "timed": True,
           "date": "2026-12-06 10:00 UTC", "peak": {"device": "H100"}, "families": [rec]}  # fmt: skip
    floor_file = tmp_path / "dit_floor_h100_2026-12-06.json"
    floor_file.write_text(json.dumps(run))
    served = REPO / "benchmarks" / "results" / "step_cache_flux_h200_2026-12-03.jsonl"
    text = dit_floor_report.report(*dit_floor_report.load([floor_file, served]))
    floor_ms = 0.25 * len(f["ops"])
    flux_floor = next(ln for ln in text.splitlines() if ln.startswith("| FLUX.1-dev | 1024x1024"))
    assert f"**{floor_ms:.1f}** (NVIDIA H100 80GB HBM3)" in flux_floor
    assert "| 1755 / 690 | <= 120 ms | no (analytic: yes) |" in flux_floor  # 140.2 ms > 120
    engine = next(ln for ln in text.splitlines() if "| FLUX.1-dev | step-cache" in ln)
    uncached = next(
        json.loads(ln)
        for ln in served.read_text().splitlines()
        if '"policy": "none"' in ln and '"alone_s"' in ln
    )
    per_step = 1e3 * uncached["alone_s"]["median"] / uncached["steps"]
    assert (
        f"| {per_step:.1f} | {floor_ms:.1f} | {per_step / floor_ms:.2f}x (floor on NVIDIA H100"
        in (engine)
    )
    glm = next(ln for ln in text.splitlines() if ln.startswith("| GLM-Image DiT | 1024x1024"))
    assert "| not measured |" in glm and "| <= 110 ms | - |" in glm


def test_several_timed_runs_on_one_machine_give_the_latest_floor_and_their_range(found, tmp_path):
    """Two timed floor files of one machine: the row shows the later run's floor, the range the
    two span and both files; the served figures are set against the later floor."""
    import dit_floor_report

    f = _found(found, "flux")
    files = []
    for day, op_ms in (("06", 0.25), ("07", 0.2)):
        timings = {
            op: {"median_ms": op_ms, "min_ms": op_ms, "reps": 4} for op, _ in grouped(f["ops"])
        }
        rec = dit_floor.family_record(f, ("H100", (989.4e12, 3.35e12)), timings, None)
        run = {"bench": "dit_floor", "machine": "NVIDIA H100 80GB HBM3", "timed": True,
               "date": f"2026-12-{day} 10:00 UTC", "peak": {"device": "H100"}, "families": [rec]}  # fmt: skip
        files.append(tmp_path / f"dit_floor_h100_2026-12-{day}.json")
        files[-1].write_text(json.dumps(run))
    floors, served = dit_floor_report.load(files)
    text = dit_floor_report.report(floors, served)
    row = next(ln for ln in text.splitlines() if ln.startswith("| FLUX.1-dev | 1024x1024"))
    late, early = 0.2 * len(f["ops"]), 0.25 * len(f["ops"])
    assert f"**{late:.1f}** (NVIDIA H100 80GB HBM3; {late:.1f}-{early:.1f} over 2 runs)" in row
    assert row.endswith("| dit_floor_h100_2026-12-07.json, dit_floor_h100_2026-12-06.json |")


def test_a_video_run_alone_is_served_beside_its_family_by_shape(tmp_path):
    """bench_video.py's records: a level-1 run at a family's served shape is that family's
    served figure (seconds per job over the steps); concurrency 2, a failed level and a shape
    no deploy file serves give no row."""
    import dit_floor_report

    base = {"size": "1280x704", "frames": 121, "steps": 50, "device": "NVIDIA H100 80GB HBM3"}
    records = [
        {**base, "system": "ours", "level": 1, "median_s": 100.0, "n": 1},
        {**base, "system": "ours", "level": 2, "median_s": 150.0, "n": 2},
        {**base, "system": "diffusers", "level": 1, "error": "OutOfMemoryError"},
        {**base, "system": "omni", "level": 1, "median_s": 90.0, "n": 1, "size": "640x352"},
    ]
    path = tmp_path / "wan_video_h100_2026-12-07.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    _, served = dit_floor_report.load([path])
    assert served == [
        {
            "family": "wan2.2-ti2v-5b",
            "figure": "video job, 1 request alone",
            "system": "vllm-omni-plugin",
            "latency_s": 100.0,
            "n": 1,
            "steps": 50,
            "device": "NVIDIA H100 80GB HBM3",
            "file": path.name,
        }
    ]
    row = next(
        ln for ln in dit_floor_report.served_table([], served) if ln.startswith("| Wan2.2 TI2V")
    )
    assert "| 100.00 (n=1) | 50 | 2000.0 |" in row


def test_benchmarks_md_video_block_is_the_report_of_the_video_results():
    """BENCHMARKS.md's wan-video block is bench_video.py's table of the video results files,
    regenerated and compared as text."""
    import bench_video

    doc = (REPO / "BENCHMARKS.md").read_text()
    block = doc.split(bench_video.REPORT_BEGIN, 1)[1].split(bench_video.REPORT_END, 1)[0]
    files = sorted((REPO / "benchmarks" / "results").glob("wan_video_*.jsonl"))
    assert files
    text = "\n".join(bench_video.table(bench_video.read_records(path)) for path in files)
    assert block.strip() == text.strip()
