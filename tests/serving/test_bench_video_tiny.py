"""benchmarks/bench_video.py end to end on the tiny Wan2.2 TI2V-5B (CPU): our server on
/v1/videos at concurrency 1 and 2, then diffusers' WanPipeline in the bench's process, one
record per system and level with each job's seconds and the frames found in its MP4; a second
call finds every record and runs nothing; a call whose budget cannot hold a server start stops
before starting one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omni_server import REPO

pytestmark = pytest.mark.slow


def bench(model, out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_video.py"), "--model", str(model),
        "--out", str(out), "--stage-config", "wan_ti2v_tiny", "--size", "64x32", "--frames", "9",
        "--steps", "2", "--jobs", "2", "--warmup-steps", "1", "--poll-s", "0.05", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


def test_bench_video_records_both_systems_and_continues(tiny_models, tmp_path):
    model, out = tiny_models("wan-ti2v"), tmp_path / "video"
    first = bench(model, out)
    assert first.stdout.rstrip().endswith("ALL_DONE"), first.stdout[-3000:]
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["system"], r["level"], r["n"], r["partial"]) for r in rows] == [
        ("ours", 1, 2, False),
        ("ours", 2, 2, False),
        ("diffusers", 1, 2, False),
    ]
    for r in rows:
        assert (r["size"], r["frames"], r["steps"], r["guidance_scale"]) == ("64x32", 9, 2, 5.0)
        assert {"vllm", "torch", "diffusers"} <= set(r["versions"]) and r["device"]
        assert "bench_video.py" in r["command"]
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and r["min_s"] > 0
        assert round(min(j["s"] for j in r["jobs"]), 2) == r["min_s"]
    for job in rows[0]["jobs"] + rows[1]["jobs"]:
        # Size as the server reports it, frames as found in the downloaded MP4.
        assert (job["size"], job["frames"], job["steps"]) == ("64x32", 9, 2)
        assert job["mp4_bytes"] > 0
    assert [j["seed"] for j in rows[2]["jobs"]] == [j["seed"] for j in rows[0]["jobs"]]
    assert not list(out.glob("video_store_*"))  # the server's job store went with it
    table = (out / "table.md").read_text()
    assert table.count("| ours |") == 2 and "| diffusers | 1 |" in table and "| 1.00x |" in table

    again = bench(model, out)
    assert (
        "ours: already recorded" in again.stdout and "diffusers: already recorded" in again.stdout
    )
    assert "ready in" not in again.stdout and again.stdout.rstrip().endswith("ALL_DONE")
    assert len((out / "results.jsonl").read_text().splitlines()) == 3

    # Another request (4 steps) with too little budget for a server start: nothing starts.
    short = bench(model, out, "--steps", "4", "--budget-s", "5", "--first-start-s", "60")
    assert "STOPPED: ours" in short.stdout and "ALL_DONE" not in short.stdout
    assert len((out / "results.jsonl").read_text().splitlines()) == 3


def test_vllm_omni_serves_its_own_deploy_file_as_shipped(tmp_path):
    """The omni system: `vllm serve MODEL --omni --deploy-config` vLLM-Omni's own
    deploy/wan2_2_ti2v.yaml from `--omni-path`, with that folder first on the server's path and
    nothing changed, or its defaults where it ships no file; an `--omni-path` without the file is
    named before any server starts."""
    from types import SimpleNamespace

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_video

    omni = tmp_path / "vomni"
    deploy = omni / bench_video.OMNI_DEPLOY_DIR / "wan2_2_ti2v.yaml"
    deploy.parent.mkdir(parents=True)
    deploy.write_text("stages: []\n")
    model = tmp_path / "wan"
    args = SimpleNamespace(model=model, omni_path=str(omni), omni_deploy="wan2_2_ti2v.yaml")
    argv, env, config = bench_video.served(args, "omni", tmp_path / "store")
    assert argv == [str(model), "--omni", "--deploy-config", str(deploy)]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(omni)
    assert config == {"deploy_config": str(deploy), "changes": []}
    # No shipped file (the A14B): vLLM-Omni's own defaults for the model.
    args.omni_deploy = ""
    assert bench_video.served(args, "omni", tmp_path)[0] == [str(model), "--omni"]
    args.omni_path, args.omni_deploy = str(tmp_path / "none"), "wan2_2_ti2v.yaml"
    with pytest.raises(FileNotFoundError, match="--omni-path"):
        bench_video.served(args, "omni", tmp_path)
