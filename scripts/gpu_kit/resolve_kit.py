#!/usr/bin/env python3
"""Download the wheels that the offline GPU machine lacks for a requirement, for its Python (3.12, x86-64).

    resolve_kit.py OUT_DIR REQUIREMENT... [--skip NAME ...]

Walks each requirement's Requires-Dist (one `pip download --no-deps` per package), leaving out what the
GPU image already has (device-packages.txt beside this file), the CUDA stack that comes with its torch,
and kernels that vLLM only imports for models and features we do not use. Prints the file name of
every wheel the kit needs, one a line, whether downloaded now or found in OUT_DIR from an earlier
run (OUT_DIR is a cache: it may hold other versions, which the kit must leave out). A package that cannot be fetched after a few tries fails the run (exit 1, naming it): a kit missing
one dependency installs without complaint and breaks only when that import runs on the GPU machine.
"""

import os
import subprocess
import sys
import time
import zipfile
from collections import deque
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
from packaging.utils import parse_wheel_filename

HERE = Path(__file__).resolve().parent
IMAGE = {cn(x) for x in (HERE / "device-packages.txt").read_text().split()}
NOT_NEEDED = {
    cn(x)
    for x in [
        "torch",
        "torchvision",
        "torchaudio",
        "triton",
        "cuda-toolkit",
        "cuda-bindings",
        "flashinfer-python",
        "flashinfer-cubin",
        "tilelang",
        "nvidia-cutlass-dsl",
        "quack-kernels",
        "humming-kernels",
        "tokenspeed-mla",
        "PyNvVideoCodec",
        "torchcodec",
        "nvidia-cudnn-frontend",
        "fastsafetensors",
        "instanttensor",
        "numba",
        "llvmlite",
        "opencv-python-headless",
        "ray",
        "openai-whisper",
        "nixl",
        "nixl-cu12",
        "nixl-cu13",
    ]
}
# Versions that work together with the image (xgrammar >= 0.2.8 needs a newer tvm-ffi than vLLM 0.26 pins).
PINS = {"xgrammar": "xgrammar==0.2.7", "apache-tvm-ffi": "apache-tvm-ffi==0.1.10"}
ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "linux_x86_64",
]


def main() -> None:
    args = sys.argv[1:]
    skip = set()
    while "--skip" in args:
        i = args.index("--skip")
        skip.add(cn(args[i + 1]))
        del args[i : i + 2]
    out, roots = Path(args[0]), args[1:]
    out.mkdir(parents=True, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    # Breadth first: every root (and its pin) is fetched before any dependency can name the
    # same project with a looser range (vllm-omni's transformers range once won over the 5.19 root).
    queue = deque(Requirement(r) for r in roots)
    root_names = {cn(r.name) for r in queue}
    seen: set[str] = set()
    failed: list[str] = []
    while queue:
        req = queue.popleft()
        name = cn(req.name)
        if name in seen or (name not in root_names and name in IMAGE | NOT_NEEDED | skip):
            continue
        seen.add(name)
        spec = PINS.get(name, str(req).split(";")[0])
        error = fetch(spec, plat, out)
        wheel = None if error else cached_wheel(Requirement(spec), out)
        if wheel is None:
            print("could not fetch", spec, error or "(no matching wheel)", file=sys.stderr)
            failed.append(spec)
            continue
        print(wheel)
        # The dependencies of a wheel found in the cache are walked too: a dependency that
        # failed to download in an earlier run is fetched now, not skipped with its parent.
        with zipfile.ZipFile(out / wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if line.startswith("Requires-Dist:"):
                dep = Requirement(line.split(":", 1)[1].strip())
                extras = [""] + list(req.extras)
                if dep.marker is None or any(
                    dep.marker.evaluate(dict(ENV, extra=e)) for e in extras
                ):
                    queue.append(dep)
    if failed:
        sys.exit(f"the kit is incomplete, not fetched: {', '.join(failed)}")


def cached_wheel(req: Requirement, out: Path) -> str | None:
    """The newest wheel in `out` of the required project that satisfies its version range."""
    found = []
    for f in os.listdir(out):
        if not f.endswith(".whl"):
            continue
        name, version, _, _ = parse_wheel_filename(f)
        if cn(name) == cn(req.name) and req.specifier.contains(version, prereleases=True):
            found.append((version, f))
    return max(found)[1] if found else None


def fetch(spec: str, plat: list[str], out: Path, tries: int = 3) -> str | None:
    """Download one wheel; None when it came, else pip's last error line after `tries` attempts
    (an index answering slowly or dropping a connection is the usual cause, and passes)."""
    for attempt in range(tries):
        p = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
            + ["--python-version", "3.12", "--implementation", "cp", *plat, "-d", str(out), spec],
            capture_output=True,
            text=True,
        )
        if p.returncode == 0:
            return None
        if attempt + 1 < tries:
            time.sleep(2 * (attempt + 1))
    return (p.stderr.strip().splitlines() or [""])[-1]


if __name__ == "__main__":
    main()
