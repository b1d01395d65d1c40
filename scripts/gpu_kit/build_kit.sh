#!/usr/bin/env bash
# Build the GPU kit on a machine with network access, for an offline GPU machine with torch 2.11 +
# CUDA 13 (-> vLLM 0.26.0): vLLM, diffusers and the project's other pure-Python needs, packed and
# split into parts of at most 58 MiB, so each fits through a size-limited transfer.
# transformers 5.19.0 replaces the image's 5.17: the same GLM-Image classes as CPU CI (the checkpoint builder and diffusers' AR).
# pycountry: mistral_common (vLLM) imports pydantic_extra_types.language_code, which needs it.
# av (PyAV): this project's own media needs (input_audio and video_url decoding, MP4 encoding) and the
# speech bench's video question; the GPU image has no PyAV.
#   scripts/gpu_kit/build_kit.sh [KIT_DIR] [EXTRA_REQUIREMENT...]      (KIT_DIR default: .gpukit)
# Then copy every part to /tmp/kit on the GPU machine (docs/benchmarks.md). Re-running reuses the download cache.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kit=${1:-.gpukit}; shift || true
cache=${GPU_KIT_CACHE:-/tmp/gpu-kit-wheels}
mkdir -p "$cache" "$kit"
python3 -m pip install -q packaging 2>/dev/null || true
# The resolver prints the wheels this kit needs; the cache may hold other versions from earlier kits.
python3 "$here/resolve_kit.py" "$cache" vllm==0.26.0 diffusers==0.42.1 transformers==5.19.0 omegaconf==2.4.0 \
  antlr4-python3-runtime==4.13.2 importlib_metadata pydantic pycountry av==18.1.0 "$@" | sort -u >"$kit/wheels.txt"
rm -f "$kit"/part_*
tar cf - -C "$cache" -T "$kit/wheels.txt" | split -b 58M -d - "$kit/part_"
# In a git worktree .git is a file: ask git where its exclude file lives.
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/$(basename "$kit")/" "$exclude" 2>/dev/null || echo "/$(basename "$kit")/" >> "$exclude"
ls -la "$kit"
echo "$(ls "$kit"/part_* | wc -l) parts: copy each to /tmp/kit on the GPU machine, then run scripts/gpu_check.sh install there"
