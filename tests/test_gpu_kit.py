"""The GPU kit's resolver (scripts/gpu_kit/resolve_kit.py) against a local wheel index: pip's own
download, with PIP_NO_INDEX / PIP_FIND_LINKS pointing at wheels this test writes, so no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

RESOLVER = Path(__file__).resolve().parents[1] / "scripts" / "gpu_kit" / "resolve_kit.py"


def write_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> str:
    """A pure-Python wheel holding only its metadata, enough for pip download and the resolver."""
    dist = f"{name}-{version}.dist-info"
    filename = f"{name}-{version}-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(folder / filename, "w") as z:
        z.writestr(f"{dist}/METADATA", "\n".join(meta) + "\n")
        z.writestr(
            f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}/RECORD", "")
    return filename


def resolve(index: Path, cache: Path, *roots: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(index), PIP_CONFIG_FILE=os.devnull)
    return subprocess.run(
        [sys.executable, str(RESOLVER), str(cache), *roots],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_dependency_missing_from_the_cache_is_fetched_under_a_cached_parent(tmp_path):
    index, cache = tmp_path / "index", tmp_path / "cache"
    index.mkdir(), cache.mkdir()
    parent = write_wheel(index, "kitparent", "1.0", ["kitchild>=2"])
    child = write_wheel(index, "kitchild", "2.1")
    write_wheel(
        cache, "kitparent", "1.0", ["kitchild>=2"]
    )  # an earlier run fetched only the parent
    write_wheel(cache, "kitchild", "1.0")  # and an older child from another kit
    run = resolve(index, cache, "kitparent==1.0")
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.split()) == sorted([parent, child])  # the old 1.0 child left out
    assert (cache / child).exists()


def test_a_dependency_that_cannot_be_fetched_fails_the_kit_naming_it(tmp_path):
    index, cache = tmp_path / "index", tmp_path / "cache"
    index.mkdir(), cache.mkdir()
    write_wheel(index, "kitparent", "1.0", ["kitabsent==3.0"])
    run = resolve(index, cache, "kitparent==1.0")
    assert run.returncode == 1
    assert "kitabsent==3.0" in run.stderr.splitlines()[-1]


GPU_CHECK = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_every_gpu_check_mode_is_documented_in_its_header():
    import re

    text = GPU_CHECK.read_text()
    modes = re.findall(r"^    ([a-z0-9-]+)\)$", text, re.M)
    documented = re.findall(r"^#   scripts/gpu_check.sh ([a-z0-9-]+)", text, re.M)
    assert "dit-floor" in modes
    assert sorted(modes) == sorted(documented)


def test_dit_floor_mode_reaches_the_benchmark_with_flags_it_accepts(tmp_path):
    """`gpu_check.sh dit-floor` runs dit_floor.py with arguments its parser takes: here, with no
    GPU, the benchmark itself refuses to time (a flag it did not know would fail first)."""
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        FLOOR_FAMILIES="flux,wan2.2-t2v-a14b",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    run = subprocess.run(
        ["bash", str(GPU_CHECK), "dit-floor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    log = (out / "dit_floor.log").read_text()
    assert "timing needs a CUDA device" in log, log
    assert "unrecognized arguments" not in log and "unknown families" not in log


@pytest.mark.slow
def test_wan_video_mode_runs_the_bench_on_a_ready_checkpoint(tmp_path):
    """`gpu_check.sh wan-video` on the tiny TI2V checkpoint (marked built), diffusers only on this
    CPU: the phase's flags reach bench_video.py, which records a run and says it is done; a
    second call finds the record and runs nothing again."""
    from vllm_omni_plugin.testing.tiny_models import build_tiny_model

    model = build_tiny_model("wan-ti2v", tmp_path / "wan-ti2v")
    (model / ".complete").touch()
    out = tmp_path / "out"
    env = dict(
        os.environ,
        OUT=str(out),
        WAN_FULL=str(model),
        WAN_STAGE_CONFIG="wan_ti2v_tiny",
        WAN_SIZE="64x32",
        WAN_FRAMES="5",
        WAN_STEPS="2",
        WAN_JOBS="1",
        WAN_SYSTEMS="diffusers",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    for _ in range(2):
        run = subprocess.run(
            ["bash", str(GPU_CHECK), "wan-video"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr
        log = (out / "wan_video" / "bench.log").read_text()
        assert "unrecognized arguments" not in log and "Traceback" not in log, log
        assert log.rstrip().endswith("ALL_DONE"), log
    assert "diffusers: already recorded" in log
    (record,) = [
        json.loads(x) for x in (out / "wan_video" / "results.jsonl").read_text().split("\n") if x
    ]
    assert (record["system"], record["level"], record["n"]) == ("diffusers", 1, 1)
    assert (record["size"], record["frames"], record["steps"]) == ("64x32", 5, 2)
    assert not (out / "wan_video" / "build.txt").exists()  # the ready folder was not rebuilt
