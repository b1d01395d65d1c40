#!/usr/bin/env bash
# The GPU measurements of BENCHMARKS.md, on an offline GPU machine (H200, torch 2.11 + CUDA 13, no network).
# Run from the project root once the kit's parts lie in /tmp/kit (docs/benchmarks.md).
#   scripts/gpu_check.sh install            unpack the kit, install it + this checkout into /tmp/site
#   scripts/gpu_check.sh smoke              tiny GLM-Image served (8 concurrent) + greedy parity
#   scripts/gpu_check.sh build-full         random-weight GLM-Image at real size in $FULL
#   scripts/gpu_check.sh placeholders       vLLM-Omni's start-up processor check on both checkpoints
#   scripts/gpu_check.sh bench PHASE...     bench_gpu_glm.py phases on $FULL (ours omni diffusers)
#   scripts/gpu_check.sh ar-served          bench_ar_served.py on $FULL: time per output token inside our
#                                           AR stage (served GLM-Image) vs stock `vllm serve` of the same
#                                           AR model, same requests and sampling, at concurrency 1 and
#                                           CONCURRENCY, alternating; AR_SYSTEMS ROUNDS ROUND_OFFSET
#                                           AR_REQUESTS AR_STEPS; results in $AR_OUT/ar_served.jsonl
#                                           (kept across calls)
#   scripts/gpu_check.sh build-full-qwen    random-weight Qwen-Image at real size in $QWEN_FULL (~58 GB)
#   scripts/gpu_check.sh fair FAMILY        bench_fair.py: ours vs vLLM-Omni shipped and tuned vs diffusers,
#                                           rounds in alternating order (glm-image on $FULL, qwen-image
#                                           on $QWEN_FULL); SYSTEMS ROUNDS ROUND_OFFSET SINGLES REQUESTS
#                                           RATE CONCURRENCY STAGE_OVERRIDES (ours); results in $FAIR_OUT
#                                           (kept across calls)
#   scripts/gpu_check.sh collect            $FAIR_OUT's results.jsonl, first images and logs (one .tgz) into
#                                           $OUT (few files: easier to copy off an offline machine)
#   scripts/gpu_check.sh dit                DiT speed: bench_attention_gpu.py + bench_dit_gpu.py,
#                                           ~8.5 min, no vLLM
#   scripts/gpu_check.sh dit-qwen-rows      Qwen-Image DiT at full size (random weights built on the GPU, no
#                                           checkpoint, no vLLM): one 1024x1024 denoising step for 8 prompts of
#                                           mixed text lengths, each alone vs batched with masked attention vs
#                                           batched per row (bench_dit_ab.py --qwen-rows), ~5 min; QWEN_ROWS_CFG=1
#                                           adds true CFG rows. Decides qwen_image.yaml's max_batch_size
#   scripts/gpu_check.sh nixl-vram          NIXL handoffs in GPU memory vs a d2d copy; when
#                                           they work, a later `smoke` serves through glm_image_1gpu_nixl
#   scripts/gpu_check.sh smoke-nixl         tiny GLM-Image served through glm_image_1gpu_nixl, both stages
#                                           eager (the connector path, not speed: ~1.5 min, no compiles)
#   scripts/gpu_check.sh headless           two GPUs: head (AR, GPU 0) + headless DiT node
#                                           (GPU 1) on $FULL, the node killed mid-request, restarted (~6 min)
#   scripts/gpu_check.sh build-full-omni    random-weight Qwen3-Omni at real size (~70 GB) in $OMNI_FULL (default:
#                                           /dev/shm/omni-full, else /tmp/omni-full, whichever has room)
#   scripts/gpu_check.sh omni-speech        bench_omni_speech.py: ours vs vLLM-Omni 0.26, rounds alternating,
#                                           bounded by what is left of CALL_LIMIT_S; runs already in
#                                           $SPEECH_OUT are kept, so the same command continues where it stopped.
#                                           SYSTEMS ROUNDS ROUND_OFFSET SINGLES SPEECH_CONCURRENCY THINKER_TOKENS FRAMES
#                                           SPEECH_INPUT (text, audio: a 10 s spoken question, video: 30 frames)
#                                           (audio-new, video-new: media the server has not seen, each request)
#                                           SPEECH_THEN ("audio:1,8 video:1": more inputs on the same server)
#                                           OMNI_FIT (auto, h200, 80gb: vLLM-Omni's memory settings; auto
#                                           picks 80gb below 100 GiB of GPU memory)
#                                           (OMNI_STAGE_CONFIG=qwen3_omni_tiny + a tiny OMNI_FULL: a CPU dry run)
#   scripts/gpu_check.sh omni-parity        the tiny Qwen3-Omni served here (bf16) vs transformers on this GPU
#   scripts/gpu_check.sh collect-omni       $SPEECH_OUT's results.jsonl, table.md and logs.tgz into $OUT/omni_speech
#   scripts/gpu_check.sh talker-step        bench_talker_step.py: the talker (vLLM's engine) at full size, decode
#                                           step time at batch 1, 8, 32 beside its bandwidth floor (no server,
#                                           <= 6 min with the ~8 GB build in /dev/shm)
#   scripts/gpu_check.sh talker-profile     the same talker at batch 1, 20 decode steps under torch's profiler:
#                                           step wall time vs GPU-busy time, kernels per step, top kernels
#   scripts/gpu_check.sh code2wav           Code2Wav's batched decode: CUDA graphs vs eager, time per chunk
#   scripts/gpu_check.sh talker-predictor   the vLLM talker's code predictor, tiny: CUDA graphs vs eager, time per step
#   scripts/gpu_check.sh step-cache-graphs  step caching with CUDA graphs kept, tiny FLUX: graphed vs eager engine,
#                                           pixel-exact (pytest, ~1.5 min)
#   scripts/gpu_check.sh step-cache-flux    bench_step_cache.py on full-size FLUX (built once in $FLUX_FULL,
#                                           default /tmp/flux-full): uncached vs cached rows (SC_ROWS) with
#                                           CUDA graphs (SC_GRAPHS=off: eager); $OUT/step_cache
#   scripts/gpu_check.sh side-lane          prepare/decode beside the denoising (overlap_encode_decode): tiny FLUX
#                                           on vs off pixel-exact with CUDA graphs, then full-size FLUX (built once
#                                           in $FLUX_FULL) off vs on in alternating rounds; $OUT/side_lane
#   scripts/gpu_check.sh wan-video          bench_video.py: Wan2.2 TI2V-5B at full size (random weights, ~23 GB, built once in
#                                           $WAN_FULL, default /dev/shm/wan-ti2v-full), seconds per video job: ours on
#                                           /v1/videos (wan2_2_ti2v) at concurrency 1 and 2 vs vLLM-Omni 0.26 (its shipped
#                                           wan2_2_ti2v.yaml) at the same levels vs diffusers' WanPipeline at
#                                           batch 1, same request (1280x704, 121 frames, 50 steps), bounded by what is left
#                                           of CALL_LIMIT_S; records kept in $OUT/wan_video, so the same command continues
#                                           where it stopped (prints STOPPED: ... or ALL_DONE). WAN_SIZE WAN_FRAMES WAN_STEPS
#                                           WAN_JOBS WAN_LEVELS WAN_SYSTEMS WAN_STAGE_CONFIG STAGE_OVERRIDES (ours);
#                                           WAN_VARIANT=a14b: T2V-A14B instead (~68 GB in $WAN_FULL, default
#                                           /dev/shm/wan-a14b-full; wan2_2, 832x480, 81 frames, 40 steps), $OUT/wan_video_a14b
#                                           (WAN_STAGE_CONFIG=wan_ti2v_tiny + a tiny WAN_FULL holding .complete + WAN_SIZE=64x64
#                                           WAN_FRAMES=9 WAN_STEPS=4: a CPU dry run)
#   scripts/gpu_check.sh dit-floor          dit_floor.py: each diffusion family's step floor (its GEMMs and attention
#                                           timed alone at the served shape) for FLUX.1-dev, Qwen-Image, GLM-Image's
#                                           DiT, Wan2.2 TI2V-5B and T2V-A14B in one call: ~3 min, no weights, no vLLM;
#                                           FLOOR_FAMILIES (comma-separated) picks some; $OUT/dit_floor/dit_floor.json
# Several commands may follow one another: `scripts/gpu_check.sh install smoke build-full`.
# Results go to $OUT (default /tmp/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
TINY=${TINY:-/tmp/glm-tiny}
FULL=${FULL:-/tmp/glm-full}
QWEN_FULL=${QWEN_FULL:-/tmp/qwen-full}
FAIR_OUT=${FAIR_OUT:-/tmp/fair}
AR_OUT=${AR_OUT:-/tmp/ar-served}
SPEECH_OUT=${SPEECH_OUT:-/tmp/speech}  # kept across invocations: a later one continues the rounds
# For machines that stop a command after 10 minutes: phases that budget themselves (omni-speech)
# stop starting new work when what is left of CALL_LIMIT_S, counted from this script's start,
# runs short. Raise it where commands may run longer.
CALL_T0=$(date +%s)
CALL_LIMIT_S=${CALL_LIMIT_S:-590}
SMOKE_CONFIG=${SMOKE_CONFIG:-glm_image_1gpu}
REPEATS=${REPEATS:-2}  # single requests (concurrency 1) per served phase, after one warm-up
CONCURRENCY=${CONCURRENCY:-8}  # then this many at once (every phase that sends requests)
STAGE_CONFIG=${STAGE_CONFIG:-glm_image_1gpu}  # the served full-size phase (`ours`)
# scripts/gpu_kit/install_kit.sh puts each system in its own folder; a phase sees only its own.
OURS_PATH=/tmp/ours:/tmp/site
export PYTHONPATH=$OURS_PATH PATH=/tmp/ours/bin:/tmp/site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The tiny checkpoint is saved in float32; on the GPU both stages run it in bf16 (vLLM's
# FlashAttention has no fp32 kernels) and at tiny sizes (the 1-GPU config's floor is 512).
TINY_OVERRIDES=${TINY_OVERRIDES:-'{"0": {"dtype": "bfloat16"}, "1": {"dtype": "bfloat16", "min_height": 64, "min_width": 64}}'}
# Extra --stage-overrides for the served full-size phase (`ours`), e.g. '{"1": {"cuda_graphs": false}}'.
STAGE_OVERRIDES=${STAGE_OVERRIDES:-}
# ENGINE_PARITY=0: the diffusers phase skips its engine-vs-diffusers image (one more full image).
# RESTART=1: the served phases start their server a second time (warm compile caches) and time
# start-up + one request (~1.5 min more each).
mkdir -p "$OUT"
# Every server a phase starts notes its process group here (benchmarks/bench_gpu_glm.py
# record_group); stop_servers ends those groups, never processes matched by name.
export OMNI_BENCH_PGID_FILE="$OUT/server_pgids"
stop_servers() {
  [ -f "$OMNI_BENCH_PGID_FILE" ] || return 0
  local pgid
  while read -r pgid; do
    [ -n "$pgid" ] || continue
    kill -TERM -- "-$pgid" 2>/dev/null || true
  done < "$OMNI_BENCH_PGID_FILE"
  sleep 2
  while read -r pgid; do
    [ -n "$pgid" ] || continue
    kill -KILL -- "-$pgid" 2>/dev/null || true
  done < "$OMNI_BENCH_PGID_FILE"
  : > "$OMNI_BENCH_PGID_FILE"
}
trap stop_servers EXIT
# Where the full-size Qwen3-Omni lives: $OMNI_FULL, else a finished build in /dev/shm or /tmp,
# else the first of the two with room for it (~66 GiB + margin); empty when neither has room.
omni_full_dir() {
  if [ -n "${OMNI_FULL:-}" ]; then echo "$OMNI_FULL"; return; fi
  local d avail
  for d in /dev/shm/omni-full /tmp/omni-full; do
    [ -f "$d/.complete" ] && { echo "$d"; return; }
  done
  for d in /dev/shm /tmp; do
    avail=$(df -Pk "$d" | awk 'NR==2 {print $4}')
    [ "${avail:-0}" -ge $((68 * 1024 * 1024)) ] && { echo "$d/omni-full"; return; }
  done
  echo ""
}
trap 'stop_servers; exit 143' TERM INT
# FLUX.1-dev at full size (random bf16 weights, ~34 GB) in $FLUX_FULL, built once; prints its
# folder, the build's time appended to the file $1.
flux_full() {
  local dir=${FLUX_FULL:-/tmp/flux-full} t0
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    t0=$(date +%s)
    python3 -c "from pathlib import Path; from vllm_omni_plugin.testing.full_flux import build; build(Path('$dir'), 0)" >&2
    touch "$dir/.complete"
    echo "flux-full: built in $(( $(date +%s) - t0 )) s" >>"$1"
  fi
  echo "$dir"
}
# Wan2.2 TI2V-5B at full size (random bf16 weights, ~23 GB) in $WAN_FULL, built once; prints
# its folder, the build's time appended to the file $1. A folder built elsewhere is used as is
# once it holds a .complete file.
wan_full() {
  # $2: the builder's family, wan-ti2v (TI2V-5B, ~23 GB) or wan (T2V-A14B, ~68 GB)
  local kind=${2:-wan-ti2v} dir t0
  if [ "$kind" = wan ]; then dir=${WAN_FULL:-/dev/shm/wan-a14b-full}; else dir=${WAN_FULL:-/dev/shm/wan-ti2v-full}; fi
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    t0=$(date +%s)
    vllm-omni-plugin make-tiny-model "$kind" "$dir" --size full >&2
    touch "$dir/.complete"
    echo "wan-full: built in $(( $(date +%s) - t0 )) s" >>"$1"
  fi
  echo "$dir"
}
# A phase starts once the GPU holds no other process's memory (an engine a failed phase left
# behind can take seconds to let go); after 90 s it names the holders and goes on.
wait_gpu_free() {
  local holders
  for _ in $(seq 90); do
    holders=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null || true)
    [ -z "$holders" ] && return 0
    sleep 1
  done
  echo "GPU still held before $1:"; echo "$holders"
}

while [ $# -gt 0 ]; do
  step=$1; shift
  case $step in install|collect|collect-omni) ;; *) wait_gpu_free "$step" ;; esac
  case $step in
    install)
      bash scripts/gpu_kit/install_kit.sh
      ;;
    smoke)
      [ -f "$TINY/model_index.json" ] || vllm-omni-plugin make-tiny-model glm-image "$TINY"
      echo "smoke: --stage-config $SMOKE_CONFIG"
      python3 benchmarks/bench_gpu_glm.py parity --model "$TINY" --out "$OUT/tiny" --size 256 \
        --steps 20 --stage-config "$SMOKE_CONFIG" --stage-overrides "$TINY_OVERRIDES" \
        --concurrency "$CONCURRENCY"
      stop_servers
      ;;
    smoke-nixl)
      [ -f "$TINY/model_index.json" ] || vllm-omni-plugin make-tiny-model glm-image "$TINY"
      eager='{"0": {"dtype": "bfloat16", "enforce_eager": true}, "1": {"dtype": "bfloat16", "min_height": 64, "min_width": 64, "compile_transformer": false, "compile_regional": false, "cuda_graphs": false}}'
      python3 benchmarks/bench_gpu_glm.py parity --model "$TINY" --out "$OUT/tiny_nixl" --size 256 \
        --steps 20 --stage-config glm_image_1gpu_nixl --stage-overrides "$eager" \
        --concurrency "$CONCURRENCY"
      stop_servers
      ;;
    nixl-vram)
      # The handoff figures; when both GPU-memory rows ran, later smoke runs serve the tiny
      # checkpoint through glm_image_1gpu_nixl (NIXL into the DiT's GPU memory) instead.
      timeout 180 python3 benchmarks/bench_nixl_vram.py | tee "$OUT/nixl_vram.txt" || true
      # Which UCX transports carried the 64 MiB READ: UCX_PROTO_INFO prints the protocol UCX
      # selected (on the single-H200 machine: "software emulation" over tcp/lo, BENCHMARKS.md).
      UCX_PROTO_INFO=y timeout 120 python3 benchmarks/bench_nixl_vram.py --sizes 64M --iters 3 \
        > "$OUT/nixl_ucx.txt" 2>&1 || true
      if tail -1 "$OUT/nixl_vram.txt" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read())["results"]; sys.exit(any("error" in x for row in r.values() for x in row.values()))'; then
        SMOKE_CONFIG=glm_image_1gpu_nixl
      fi
      ;;
    headless)
      python3 benchmarks/bench_two_gpu_glm.py headless --model "$FULL" --out "$OUT/two_gpu" \
        --stage-config "${TWO_GPU_CONFIG:-glm_image}" --repeats "$REPEATS"
      stop_servers
      ;;
    placeholders)
      # vLLM's start-up dummy image through vLLM-Omni's GLM-Image processor, on both checkpoints.
      for dir in "$TINY" "$FULL"; do
        [ -f "$dir/model_index.json" ] || continue
        PYTHONPATH=/tmp/vomni:$OURS_PATH python3 -m vllm_omni_plugin.testing.glm_image_placeholders "$dir" || true
      done
      ;;
    build-full)
      [ -f "$FULL/model_index.json" ] || vllm-omni-plugin make-tiny-model glm-image "$FULL" --size full
      du -sh "$FULL"
      ;;
    bench)
      for phase in "$@"; do
        if [ "$phase" = omni ]; then
          # vLLM-Omni with its own general plugin only; ours is on the path for vLLM's
          # logits-processor entry point (bench_gpu_glm.py: the omni phase says why).
          PYTHONPATH=/tmp/vomni:$OURS_PATH VLLM_PLUGINS=vllm_omni_register_models \
            python3 benchmarks/bench_gpu_glm.py omni \
            --model "$FULL" --out "$OUT/full" --repeats "$REPEATS" --concurrency "$CONCURRENCY" \
            $([ "${RESTART:-0}" = 1 ] && echo --restart)
        else
          python3 benchmarks/bench_gpu_glm.py "$phase" --model "$FULL" --out "$OUT/full" \
            --repeats "$REPEATS" --concurrency "$CONCURRENCY" --stage-config "$STAGE_CONFIG" \
            ${STAGE_OVERRIDES:+--stage-overrides "$STAGE_OVERRIDES"} \
            $([ "${ENGINE_PARITY:-1}" = 0 ] && echo --no-engine-parity) \
            $([ "${RESTART:-0}" = 1 ] && echo --restart)
        fi
        # A phase cut short by a timeout can leave its server behind: never let it share the
        # GPU with the next phase.
        stop_servers
      done
      shift $#
      ;;
    build-full-qwen)
      [ -f "$QWEN_FULL/model_index.json" ] || vllm-omni-plugin make-tiny-model qwen-image "$QWEN_FULL" --size full
      du -sh "$QWEN_FULL"
      ;;
    fair)
      family=$1; shift
      mkdir -p "$FAIR_OUT"
      model=$FULL; [ "$family" = qwen-image ] && model=$QWEN_FULL
      # FAIR_TIMEOUT_S bounds the run (e.g. under a job's time limit); its servers are stopped below.
      timeout "${FAIR_TIMEOUT_S:-86400}" \
        python3 benchmarks/bench_fair.py run --family "$family" --model "$model" --out "$FAIR_OUT" \
        --systems "${SYSTEMS:-ours,omni,omni-tuned,diffusers}" --rounds "${ROUNDS:-1}" \
        --round-offset "${ROUND_OFFSET:-0}" --singles "${SINGLES:-$REPEATS}" \
        --requests "${REQUESTS:-32}" --concurrency "$CONCURRENCY" ${RATE:+--rate "$RATE"} \
        ${STAGE_OVERRIDES:+--stage-overrides "$STAGE_OVERRIDES"} \
        --omni-path /tmp/vomni 2>&1 | tee -a "$FAIR_OUT/bench_fair.log" || true
      stop_servers
      ;;
    ar-served)
      mkdir -p "$AR_OUT"
      # AR_TIMEOUT_S bounds the run (e.g. under a job's time limit); its servers are stopped below.
      timeout "${AR_TIMEOUT_S:-86400}" \
        python3 benchmarks/bench_ar_served.py run --model "$FULL" --out "$AR_OUT" \
        --stage-config "$STAGE_CONFIG" ${STAGE_OVERRIDES:+--stage-overrides "$STAGE_OVERRIDES"} \
        --systems "${AR_SYSTEMS:-ours,stock}" --rounds "${ROUNDS:-1}" \
        --round-offset "${ROUND_OFFSET:-0}" --requests "${AR_REQUESTS:-8}" \
        --steps "${AR_STEPS:-50}" --concurrency "$CONCURRENCY" \
        2>&1 | tee -a "$AR_OUT/bench_ar_served.log" || true
      stop_servers
      mkdir -p "$OUT/ar_served"
      cp "$AR_OUT/ar_served.jsonl" "$OUT/ar_served/" 2>/dev/null || true
      ;;
    collect)
      stop_servers  # what an earlier call cut short by `timeout` left running
      mkdir -p "$OUT/fair"
      cp "$FAIR_OUT/results.jsonl" "$OUT/fair/" 2>/dev/null || true
      for f in "$FAIR_OUT"/images/*_0.png; do [ -f "$f" ] && cp "$f" "$OUT/fair/"; done
      tar czf "$OUT/fair/logs.tgz" -C "$FAIR_OUT" --exclude images . 2>/dev/null || true
      ;;
    build-full-omni)
      dir=$(omni_full_dir)
      df -h /dev/shm /tmp | tee "$OUT/omni_full_df.txt"
      if [ -z "$dir" ]; then
        echo "build-full-omni: neither /dev/shm nor /tmp has ~68 GiB free (see above)" >&2
        exit 3
      fi
      if [ ! -f "$dir/.complete" ]; then
        rm -rf "$dir"
        t0=$(date +%s)
        vllm-omni-plugin make-tiny-model qwen3-omni "$dir" --size full
        touch "$dir/.complete"  # a build cut short is rebuilt, never served
        echo "build-full-omni: $(( $(date +%s) - t0 )) s into $dir" | tee -a "$OUT/omni_full_df.txt"
      fi
      du -sh "$dir" | tee -a "$OUT/omni_full_df.txt"
      ;;
    omni-speech)
      dir=$(omni_full_dir)
      [ -f "$dir/.complete" ] || { echo "omni-speech: run build-full-omni first" >&2; exit 3; }
      mkdir -p "$SPEECH_OUT"
      left=$(( CALL_LIMIT_S - ($(date +%s) - CALL_T0) - 20 ))
      if [ "$left" -lt 120 ]; then
        echo "omni-speech: ${left} s left in this call, not starting; run it again"
      else
        # The bench starts a run only when its estimate fits its budget; `timeout` is the backstop
        # (a run it cuts short leaves no record and is redone in the next call).
        timeout "$left" python3 benchmarks/bench_omni_speech.py run --model "$dir" \
          --out "$SPEECH_OUT" --systems "${SYSTEMS:-ours,omni}" --rounds "${ROUNDS:-3}" \
          --round-offset "${ROUND_OFFSET:-0}" --singles "${SINGLES:-3}" --levels "${SPEECH_CONCURRENCY:-1,8,32}" \
          --thinker-tokens "${THINKER_TOKENS:-64}" --frames "${FRAMES:-128}" \
          --input "${SPEECH_INPUT:-text}" \
          $(for t in ${SPEECH_THEN:-}; do printf -- '--then %s ' "$t"; done) \
          --budget-s "$((left - 15))" --first-run-s "${FIRST_RUN_S:-300}" --omni-path /tmp/vomni --omni-fit "${OMNI_FIT:-auto}" \
          --stage-config "${OMNI_STAGE_CONFIG:-qwen3_omni_1gpu}" \
          ${STAGE_OVERRIDES:+--stage-overrides "$STAGE_OVERRIDES"} \
          2>&1 | tee -a "$SPEECH_OUT/bench.log" || true
      fi
      stop_servers
      ;;
    omni-parity)
      # The tiny checkpoint served here (qwen3_omni_1gpu, bf16) vs transformers
      # on this GPU: thinker ids, transcript, WAV (where they part). ~2 min.
      timeout 420 python3 benchmarks/omni_served_parity.py --out "$OUT/omni_parity" 2>&1 \
        | tail -5 || true
      stop_servers
      ;;
    talker-step)
      timeout 360 python3 benchmarks/bench_talker_step.py \
        --work "${TALKER_WORK:-/dev/shm/talker-full}" --out "$OUT/talker_step" \
        2>&1 | tee "$OUT/talker_step.log" | tail -30 || true
      ;;
    talker-profile)
      # Where a talker step's time goes at batch 1: 20 decode steps under torch's profiler, the
      # engine in this process (wall vs GPU-busy time per step, kernels per step, top kernels).
      timeout 300 python3 benchmarks/bench_talker_step.py \
        --work "${TALKER_WORK:-/dev/shm/talker-full}" --out "$OUT/talker_profile" \
        --batches 1 --samplings greedy --profile 1 \
        2>&1 | tee "$OUT/talker_profile.log" | tail -60 || true
      ;;
    code2wav)
      # Code2Wav's batched decode, tiny and full-size widths: CUDA graphs vs eager, time per
      # chunk at batch 1/8/32 for both window lengths. Under 2 min.
      timeout 300 python3 benchmarks/code2wav_gpu_check.py --out "$OUT/code2wav_gpu.json" \
        2>&1 | tail -60 || true
      ;;
    talker-predictor)
      # The vLLM talker's code predictor, tiny checkpoint: its CUDA graphs vs its eager
      # path (codes, frames, seeds) and its time per step at batch 1/8/32. Under 2 min.
      timeout 300 python3 benchmarks/talker_predictor_gpu_check.py \
        --out "$OUT/talker_predictor.json" 2>&1 | tail -80 || true
      ;;
    step-cache-graphs)
      # Step caching with the engine's CUDA graphs kept, tiny FLUX in bf16: the graphed engine
      # against the eager one, policy by policy, alone and batched (pixel-exact). ~1.5 min.
      mkdir -p "$OUT/step_cache"
      timeout 300 python3 -m pytest -q -p no:cacheprovider \
        tests/diffusion/test_step_cache_graphs_gpu.py 2>&1 | tail -15 \
        | tee "$OUT/step_cache/graphs_pytest.txt" || true
      ;;
    step-cache-flux)
      # bench_step_cache.py on FLUX.1-dev at full size (random weights, ~34 GB in $FLUX_FULL,
      # built once), 1024x1024, 50 steps: the uncached engine and the cached rows SC_ROWS, with
      # CUDA graphs (SC_GRAPHS=off: eager), bounded by what is left of CALL_LIMIT_S.
      mkdir -p "$OUT/step_cache"
      flux_dir=$(flux_full "$OUT/step_cache/build.txt")
      left=$(( CALL_LIMIT_S - ($(date +%s) - CALL_T0) - 20 ))
      # shellcheck disable=SC2086  # SC_ROWS is a list of settings
      timeout "$left" python3 benchmarks/bench_step_cache.py --model "$flux_dir" --family flux \
        --out "$OUT/step_cache/flux_graphs_${SC_GRAPHS:-on}${SC_COMPILE:+_compiled}" \
        --cuda-graphs "${SC_GRAPHS:-on}" ${SC_COMPILE:+--compile-regional} \
        --rows ${SC_ROWS:-none taylorseer:5 teacache:0.4 first_block:0.08} \
        --budget-s "$((left - 60))" 2>&1 | grep -v Loading | tail -20 || true
      ;;
    side-lane)
      # Prepare and decode on the side lane (overlap_encode_decode) on the GPU: tiny FLUX in
      # bf16 with CUDA graphs, on vs off pixel-exact (~1 min); then FLUX.1-dev at full size
      # (random weights, built once), 1024x1024, 28 steps, 8 requests one every 1.5 s, off
      # and on in alternating rounds, one engine at a time.
      mkdir -p "$OUT/side_lane"
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/diffusion/test_side_lane_gpu.py \
        2>&1 | tail -15 | tee "$OUT/side_lane/gpu_pytest.txt" || true
      flux_dir=$(flux_full "$OUT/side_lane/build.txt")
      left=$(( CALL_LIMIT_S - ($(date +%s) - CALL_T0) - 20 ))
      timeout "$left" python3 benchmarks/bench_side_lane.py --model "$flux_dir" --steps 28 \
        --requests 8 --interval-ms 1500 --rounds "${SIDE_LANE_ROUNDS:-2}" \
        --out "$OUT/side_lane/results_$(date +%Y%m%d_%H%M%S).jsonl" 2>&1 \
        | grep -v Loading | tee "$OUT/side_lane/flux_full.txt" | tail -8 || true
      ;;
    wan-video)
      # Seconds per video job at full size: our server, then vLLM-Omni's (each fresh in its call,
      # one short warm-up job) at concurrency 1 then 2, then diffusers in the bench's process; each (system, level)
      # is recorded as it finishes and never run twice, so later calls continue the run.
      # WAN_VARIANT=a14b: T2V-A14B as its card and wan2_2.yaml serve it (832x480, 81 frames,
      # 40 steps, guidance 4.0); vLLM-Omni ships no deploy file for it and runs its defaults.
      if [ "${WAN_VARIANT:-ti2v}" = a14b ]; then
        wan_kind=wan wan_out="$OUT/wan_video_a14b" wan_cfg=wan2_2 wan_size=832x480
        wan_frames=81 wan_steps=40 wan_guidance=4.0 wan_omni_deploy=""
      else
        wan_kind=wan-ti2v wan_out="$OUT/wan_video" wan_cfg=wan2_2_ti2v wan_size=1280x704
        wan_frames=121 wan_steps=50 wan_guidance=5.0 wan_omni_deploy=wan2_2_ti2v.yaml
      fi
      mkdir -p "$wan_out"
      wan_dir=$(wan_full "$wan_out/build.txt" "$wan_kind")
      left=$(( CALL_LIMIT_S - ($(date +%s) - CALL_T0) - 20 ))
      if [ "$left" -lt 120 ]; then
        echo "wan-video: ${left} s left in this call, not starting; run it again"
      else
        timeout "$left" python3 benchmarks/bench_video.py --model "$wan_dir" --out "$wan_out" \
          --stage-config "${WAN_STAGE_CONFIG:-$wan_cfg}" --size "${WAN_SIZE:-$wan_size}" \
          --frames "${WAN_FRAMES:-$wan_frames}" --steps "${WAN_STEPS:-$wan_steps}" \
          --guidance "$wan_guidance" --jobs "${WAN_JOBS:-2}" --levels "${WAN_LEVELS:-1,2}" \
          --systems "${WAN_SYSTEMS:-ours,omni,diffusers}" --omni-deploy "$wan_omni_deploy" \
          ${STAGE_OVERRIDES:+--stage-overrides "$STAGE_OVERRIDES"} --budget-s "$((left - 15))" \
          2>&1 | grep -v Loading | tee -a "$wan_out/bench.log" | tail -30 || true
      fi
      stop_servers
      ;;
    collect-omni)
      stop_servers
      mkdir -p "$OUT/omni_speech"
      cp "$SPEECH_OUT/results.jsonl" "$OUT/omni_speech/" 2>/dev/null || true
      python3 benchmarks/omni_speech_report.py "$SPEECH_OUT/results.jsonl" \
        > "$OUT/omni_speech/table.md" 2>&1 || true
      tar czf "$OUT/omni_speech/logs.tgz" -C "$SPEECH_OUT" . 2>/dev/null || true
      ;;
    dit)
      # Attention kernels at the served shapes (~30 s), then step variants, GLM CFG step,
      # served-shape sequence, end to end; random weights built on the GPU. DIT_BUDGET_S bounds
      # bench_dit_gpu.py (it skips what no longer fits).
      timeout 120 python3 benchmarks/bench_attention_gpu.py --out "$OUT/dit" || true
      python3 benchmarks/bench_dit_gpu.py --budget-s "${DIT_BUDGET_S:-460}" --out "$OUT/dit" \
        2>&1 | tee "$OUT/dit.log"
      ;;
    dit-floor)
      # Ops recorded on fake full-size transformers (seconds, CPU), then each distinct op timed
      # alone and the whole step's op list replayed in one CUDA graph: ~3 min for all five
      # (Wan2.2 T2V-A14B's 3.4 PFLOP CFG step is most of it). Stops itself at --budget-s.
      timeout 590 python3 benchmarks/dit_floor.py --out "$OUT/dit_floor" --budget-s 540 \
        ${FLOOR_FAMILIES:+--families "$FLOOR_FAMILIES"} 2>&1 | tee "$OUT/dit_floor.log" \
        | grep -v '^| ' || true
      ;;
    dit-qwen-rows)
      if [ "${QWEN_ROWS_CFG:-0}" = 1 ]; then
        python3 benchmarks/bench_dit_ab.py --qwen-rows --cfg --out "$OUT/qwen_rows_cfg" \
          2>&1 | tee "$OUT/qwen_rows_cfg.log"
      else
        python3 benchmarks/bench_dit_ab.py --qwen-rows --out "$OUT/qwen_rows" \
          2>&1 | tee "$OUT/qwen_rows.log"
      fi
      ;;
    *)
      echo "unknown step: $step" >&2
      exit 2
      ;;
  esac
done
