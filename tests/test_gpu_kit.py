"""The GPU kit's resolver (scripts/gpu_kit/resolve_kit.py) against a local wheel index: pip's own
download, with PIP_NO_INDEX / PIP_FIND_LINKS pointing at wheels this test writes, so no network."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

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
