#!/usr/bin/env bash
# Step caching on one GPU (measured on an H200): FLUX.1-dev, Qwen-Image and GLM-Image's
# DiT (random AR image tokens) at full size (random weights built on the GPU), 1024x1024, 50 steps,
# through benchmarks/bench_step_cache.py. FAMILIES picks and orders them (default "flux qwen glm").
# No vLLM needed: the diffusion engine imports without it, so the kit is four wheels (~19 MiB, one
# carry) from scripts/gpu_kit/build_kit.sh's download cache: diffusers 0.42.1, transformers 5.19.0,
# cache-dit 1.3.0, importlib_metadata. Put them in $WHEELS on the GPU machine.
#   scripts/gpu_step_cache.sh wait SECONDS   start the job once (setsid: it outlives this command) and
#                                           wait up to SECONDS, copying its results into $OUT
# flux + qwen need ~17 min of machine time: where one command may run at most 10 minutes, run
# `wait` again until it prints ALL_DONE; results accumulate in /tmp/sc. glm alone (FAMILIES=glm)
# ~8 min. Budgets (seconds): FLUX_BUDGET (engine rows, 420), FLUX_DIFFUSERS_BUDGET (100),
# QWEN_BUDGET (240), GLM_BUDGET (300).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.gpurun/whl}
S=/tmp/sc
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$S" "$OUT"
flux() {
  echo "$(date -u +%T) build flux"
  [ -f /tmp/flux-full/model_index.json ] || python3 -c "from pathlib import Path; from vllm_omni_plugin.testing.full_flux import build; build(Path('/tmp/flux-full'), 0)"
  echo "$(date -u +%T) bench flux"
  python3 benchmarks/bench_step_cache.py --model /tmp/flux-full --family flux --out $S/flux \
    --budget-s "${FLUX_BUDGET:-420}" --diffusers --diffusers-budget-s "${FLUX_DIFFUSERS_BUDGET:-100}" 2>&1 | grep -v Loading
  echo "$(date -u +%T) FLUX_DONE"
  rm -rf /tmp/flux-full  # the 64 GB disk and 128 GB memory do not hold two checkpoints
}
qwen() {
  echo "$(date -u +%T) build qwen"
  python3 -c "from pathlib import Path; from vllm_omni_plugin.testing.full_qwen_image import build; build(Path('/dev/shm/qwen-full'), 0)"
  echo "$(date -u +%T) bench qwen"
  python3 benchmarks/bench_step_cache.py --model /dev/shm/qwen-full --family qwen-image --out $S/qwen \
    --rows none first_block:0.08 teacache:0.4 taylorseer:5 first_block:0.12 --budget-s "${QWEN_BUDGET:-240}" \
    --diffusers --hooks none first_block:0.08 --diffusers-budget-s 60 2>&1 | grep -v Loading
  echo "$(date -u +%T) QWEN_DONE"
  rm -rf /dev/shm/qwen-full
}
# GLM-Image: the DiT paints from random AR image tokens (bench_step_cache.glm_conditioning); the
# AR model is built too (the pipeline folder loads it) but never runs. diffusers' cache hooks do
# not register GLM-Image's blocks: its row is the uncached distance only.
glm() {
  echo "$(date -u +%T) build glm"
  python3 -c "from pathlib import Path; from vllm_omni_plugin.testing.full_glm_image import build; build(Path('/dev/shm/glm-full'), 0, device='cuda')"
  echo "$(date -u +%T) bench glm"
  python3 benchmarks/bench_step_cache.py --model /dev/shm/glm-full --family glm-image --out $S/glm \
    --rows none taylorseer:5 teacache:0.4 first_block:0.08 --budget-s "${GLM_BUDGET:-300}" \
    --diffusers --hooks none --diffusers-budget-s 60 2>&1 | grep -v Loading
  echo "$(date -u +%T) GLM_DONE"
  rm -rf /dev/shm/glm-full
}
job() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  nvidia-smi --query-gpu=name,memory.total,power.limit,driver_version --format=csv
  python3 -c "import torch, diffusers, transformers, cache_dit; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__, 'cache_dit', cache_dit.__version__)"
  for family in ${FAMILIES:-flux qwen glm}; do "$family"; done
  echo "$(date -u +%T) ALL_DONE"
}
case ${1:-} in
  job) job ;;
  wait)
    if [ ! -f $S/started ]; then
      touch $S/started
      setsid nohup "$0" job > $S/job.log 2>&1 < /dev/null &
    fi
    end=$(( $(date +%s) + ${2:-550} ))
    while [ "$(date +%s)" -lt $end ] && ! grep -q ALL_DONE $S/job.log; do sleep 5; done
    cp $S/job.log "$OUT"/
    for f in flux qwen glm; do [ -f $S/$f/results.jsonl ] && cp $S/$f/results.jsonl "$OUT/$f.jsonl"; done
    grep -v '^\s*$' $S/job.log | cut -c1-600 | tail -40
    ;;
  *) echo "usage: $0 wait SECONDS | job" >&2; exit 2 ;;
esac
