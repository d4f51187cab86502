#!/usr/bin/env bash
# The CUDA path on a lent GPU, in one run (<= 9 minutes): GPU tests, put/get bandwidth, layer
# pipelining. Run from the repository root. Installs nothing but wheels found in .whl/ (for what
# the image lacks: pytest & co, cbor2, orjson; `bash bench/device_kit.sh` downloads them) and
# uses the checkout through PYTHONPATH.
# Results: bench/results/gpu_*.json, and copies + logs under $OUT (at most 8 files).
# Every step is bounded by `timeout`; a failed step does not stop the others; the summary lists
# each step's exit code. Without CUDA it says so and exits 0 after the import checks.
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT="${OUT:-$ROOT/bench/results/gpu_out}"
LOGS=/tmp/gpu_suite_logs          # logs go into $OUT/results.tgz ($OUT takes at most 8 files)
rm -rf "$LOGS"; mkdir -p "$OUT" "$LOGS" bench/results
T0=$(date +%s)
SUMMARY="$LOGS/summary.txt"
: > "$SUMMARY"
declare -A RC

log() { echo "[gpu_suite +$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUMMARY"; }

# -- environment -------------------------------------------------------------------------------
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR="${NUMBA_CACHE_DIR:-/tmp/tract-numba-cache}"
SHIM=/tmp/tract-pypath
mkdir -p "$SHIM"
ln -sfn "$ROOT/kernels" "$SHIM/tract_kernels"        # pyproject maps kernels/ -> tract_kernels
export PYTHONPATH="$ROOT:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}

# the NIXL wheels (~59 MB) plus the tree can pass the 64 MiB a device call carries; an
# installed copy packed with xz (~31 MB: unzip both wheels into one folder, tar -cJf) fits
if [ -f .whlnixl/nixl-site.tar.xz ] && ! $PY -c "import nixl._api" 2>/dev/null; then
  log "unpacking NIXL from .whlnixl/nixl-site.tar.xz into /tmp/site-nixl"
  mkdir -p /tmp/site-nixl && tar -xJf .whlnixl/nixl-site.tar.xz -C /tmp/site-nixl \
    >>"$LOGS/setup.log" 2>&1
  RC[setup_nixl]=$?
  export PYTHONPATH="$PYTHONPATH:/tmp/site-nixl"
fi
if [ -d .whlnixl ] && ls .whlnixl/*.whl >/dev/null 2>&1 && ! $PY -c "import nixl._api" 2>/dev/null; then
  log "installing NIXL from .whlnixl/ into /tmp/site-nixl"
  timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-nixl \
    .whlnixl/*.whl >>"$LOGS/setup.log" 2>&1
  RC[setup_nixl]=$?
  export PYTHONPATH="$PYTHONPATH:/tmp/site-nixl"
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  need=()
  for mod in pytest pytest_asyncio pytest_timeout cbor2 orjson; do
    $PY -c "import $mod" 2>/dev/null || need+=("$mod")
  done
  if [ ${#need[@]} -gt 0 ]; then
    log "installing from .whl/: ${need[*]}"
    timeout 120 $PY -m pip install -q --no-index --find-links .whl \
      $(printf '%s\n' "${need[@]}" | sed 's/_/-/g') >>"$LOGS/setup.log" 2>&1
    RC[setup]=$?
  fi
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1 | head -3
  $PY - <<'PY'
import importlib
for m in ("torch", "triton", "numba", "transformers", "pytest", "pytest_asyncio", "cbor2", "orjson", "pynvml"):
    try:
        mod = importlib.import_module(m)
        print(f"{m} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"{m} MISSING ({type(e).__name__}: {e})")
import torch
print("cuda available:", torch.cuda.is_available(), torch.version.cuda)
import tract_async, tract_kernels, tract_async.cuda.api
print("tract_async from", tract_async.__file__)
PY
  df -h /dev/shm | tail -1
} >>"$LOGS/setup.log" 2>&1
RC[env]=$?
cat "$LOGS/setup.log" | tee -a "$SUMMARY" >/dev/null
# the engine's own imports (cbor2, orjson come from .whl/): without them every step fails, slowly
if ! $PY -c "import cbor2, orjson, tract_async.engine, tract_async.transport.xfer" >>"$SUMMARY" 2>&1; then
  log "the engine does not import (is .whl/ carried? see above): stopping before any step"
  cp "$SUMMARY" "$OUT/summary.txt"
  exit 3
fi
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  log "no CUDA device: skipping the GPU steps (imports: rc=${RC[env]})"
  cat "$SUMMARY"
  exit "${RC[env]}"
fi

# -- results (refreshed after every step: a call cut short keeps what finished) ---------------
# everything the steps wrote under bench/results, with the logs, in one archive
finish() {
  cp "$SUMMARY" "$OUT/summary.txt"
  { find bench/results -newer "$LOGS/setup.log" -type f; find "$LOGS" -type f; } \
    | tar -czf "$OUT/results.tgz" -T - 2>/dev/null
}

step() {  # step NAME SECONDS CMD...  (output to $LOGS/NAME.log, then into the archive)
  local name=$1 secs=$2; shift 2
  log "step $name (limit ${secs}s): $*"
  timeout --kill-after=10 "$secs" "$@" >"$LOGS/$name.log" 2>&1
  RC[$name]=$?
  log "step $name: rc=${RC[$name]}"
  tail -25 "$LOGS/$name.log" | sed "s/^/  [$name] /" >>"$SUMMARY"
  finish
}

# -- steps -------------------------------------------------------------------------------------
# STEPS (space-separated) picks steps by name; the default is the GPU set below. Named steps:
#   warmup gpu_tests gpu_putget gpu_pipeline gpu_pipeline_si transport_gpu_tests
#   gpu_layers (bench/gpu_layers.py: issue 35's acceptance run, ~2-4 min)
#   putget_cpu (bench/putget.py on the host's cores, NIXL in the same run)
#   serve_gpu (bench/serve_gpu.py, three modes)  serve_load (bench/serve_load.py --size h200)
#   prefill_shapes (bench/prefill_shapes.py: a first-seen prompt length's prefill, cuDNN SDPA
#   allowed or not, ~1-2 min)
#   host_profile (bench/host_profile.py: where a layer operation's host time goes, cProfile)
#   doorbell_tests (tests/engine/test_doorbell.py: same-host wake-ups on these cores)
#   wakeup (bench/wakeup.py: the doorbell's wake-up against a bare datagram wake-up)
#   transport_cpu / transport_gpu (bench/transport.py --quick, DRAM / VRAM, 3 rounds)
#   wakecost (bench/wakecost.py: wake-up latency and what an operation costs right after one)
#   handoff_spin_ab (bench/putget.py --parts 2 with the wait's spin 0, 300 µs, the host's default)
#   copy_batch (bench/copy_batch.py: one layer by 2-D copies against one cudaMemcpyBatchAsync,
#   blocks evenly spaced and scattered, raw pinned copies in the same run, ~1 min)
#   batch_ab (TRACT_CUDA_BATCH off / auto: bench/gpu_layers.py, then bench/host_profile.py
#   --blocks 213, whose slots LRU scatters; ~2 min)
#   dma_memory (bench/dma_memory.py: raw copies into cudaHostAlloc, registered /dev/shm and
#   huge-page memory, contiguous and in the whole-prompt pattern; ~30 s)
#   gpu_trace (bench/gpu_trace.py: a whole prompt, one-block layers, the 32-block pipelined
#   prefill and a Llama-3-8B prefill with layer puts on the device's clock, then the whole
#   prompt and one-block layers with the early copies off; ~3 min)
#   early_ab (TRACT_CUDA_EARLY 1 / 0 / 1 / 0: bench/gpu_layers.py --sections whole_prompt,
#   9 reps each; ~1 min)
#   whole_ab (TRACT_CUDA_WHOLE planes / blocks / planes / blocks: the same; ~1 min)
STEPS="${STEPS:-warmup gpu_tests gpu_putget gpu_pipeline gpu_pipeline_si transport_gpu_tests}"
want() { [[ " $STEPS " == *" $1 "* ]]; }
# a fresh host has a cold Numba cache: compile every jitted path once, outside the tests' limits
# (on two cold hosts the test step ran out of its time after 61 of 63 tests; warm: ~55-115 s)
want warmup && step warmup 180 $PY -m tract_async.tools.warmup
want gpu_tests && step gpu_tests "${GPU_TESTS_S:-270}" $PY -m pytest -q -m gpu -p no:cacheprovider \
  -o addopts="" tests/cuda/test_cuda_gpu.py tests/cuda/test_layer_streams_gpu.py tests/cuda/test_early_copies_gpu.py tests/cuda/test_whole_blocks_gpu.py tests/engine/test_txn.py tests/engine/test_fallback.py \
  tests/serving/test_batching.py tests/serving/test_serving_model.py --maxfail=10
want doorbell_tests && step doorbell_tests 120 $PY -m pytest -q -p no:cacheprovider -o addopts= \
  tests/engine/test_doorbell.py
want putget_cpu && step putget_cpu "${PUTGET_S:-240}" $PY bench/putget.py --deadline-s "${PUTGET_S:-240}"
want gpu_putget && step gpu_putget 130 $PY bench/gpu_putget.py --budget-s 95
want gpu_pipeline && step gpu_pipeline 170 $PY bench/gpu_pipeline.py --budget-s 120
# issue 35's acceptance run (layer ops, whole prompt, pipelined prefill, two-process handoff)
want gpu_layers && step gpu_layers 300 $PY bench/gpu_layers.py --budget-s 200
# diagnostic: the same short prefills with a 200 µs GIL switch interval (see --help)
want gpu_pipeline_si && step gpu_pipeline_si 100 $PY bench/gpu_pipeline.py --budget-s 60 \
  --tokens 1024 2048 --timeline-tokens 0 --switch-interval-us 200 --name gpu_pipeline_si
if want transport_gpu_tests && $PY -c "import pytest_asyncio, orjson" 2>/dev/null; then
  step transport_gpu_tests 90 $PY -m pytest -q -m gpu -p no:cacheprovider \
    --continue-on-collection-errors tests/transport/test_transport_gpu.py \
    tests/transport/test_engine_nixl.py
fi
want wakeup && step wakeup 150 $PY bench/wakeup.py --n 400
want transport_cpu && step transport_cpu "${TRANSPORT_S:-200}" $PY bench/transport.py --quick --rounds 3
want transport_gpu && step transport_gpu "${TRANSPORT_S:-200}" $PY bench/transport.py --quick --gpu \
  ${TRANSPORT_GPU_ARGS:---rounds 3}
want wakecost && step wakecost 120 $PY bench/wakecost.py --reps 200
# A/B of the loop spin of a same-host wait (EngineConfig.wait_spin_us, stores/waits.py
# auto_wait_spin_us; the environment overrides it): handoffs only, 0 / 300 µs / the host's default
want handoff_spin_ab && { TRACT_WAIT_SPIN_US=0 step handoff_spin0 120 $PY bench/putget.py --parts 2 --deadline-s 110
  f=$(ls -t bench/results/putget-2*.json | head -1) && mv "$f" "${f/putget-/putget-handoff-spin0-}"
  TRACT_WAIT_SPIN_US=300 step handoff_spin300 120 $PY bench/putget.py --parts 2 --deadline-s 110
  f=$(ls -t bench/results/putget-2*.json | head -1) && mv "$f" "${f/putget-/putget-handoff-spin300-}"
  TRACT_WAIT_SPIN_US= step handoff_spin_auto 120 $PY bench/putget.py --parts 2 --deadline-s 110
  f=$(ls -t bench/results/putget-2*.json | head -1) && mv "$f" "${f/putget-/putget-handoff-spin-auto-}"; finish; }
want serve_gpu && TRACT_PHASES=1 step serve_gpu "${SERVE_GPU_S:-330}" $PY bench/serve_gpu.py --budget "$(( ${SERVE_GPU_S:-330} - 30 ))"
want prefill_shapes && step prefill_shapes 200 $PY bench/prefill_shapes.py
want host_profile && step host_profile 150 $PY bench/host_profile.py --blocks "${PROFILE_BLOCKS:-1}"
want copy_batch && step copy_batch 150 $PY bench/copy_batch.py
want dma_memory && step dma_memory 120 $PY bench/dma_memory.py
want gpu_trace && { step gpu_trace_early1 200 $PY bench/gpu_trace.py \
    --name "gpu-trace-early1-$(date -u +%Y%m%d-%H%M%S)"
  TRACT_CUDA_EARLY=0 step gpu_trace_early0 100 $PY bench/gpu_trace.py --parts whole layer1 \
    --name "gpu-trace-early0-$(date -u +%Y%m%d-%H%M%S)"; }
want whole_ab && for r in 1 2; do for w in planes blocks; do
  TRACT_CUDA_WHOLE=$w step "whole_prompt_${w}_$r" 60 $PY bench/gpu_layers.py \
    --sections whole_prompt --reps 9 --budget-s 45 \
    --name "gpu-layers-whole-$w-$r-$(date -u +%Y%m%d-%H%M%S)"
done; done
want early_ab && for r in 1 2; do for e in 1 0; do
  TRACT_CUDA_EARLY=$e step "whole_prompt_early${e}_$r" 60 $PY bench/gpu_layers.py \
    --sections whole_prompt --reps 9 --budget-s 45 \
    --name "gpu-layers-early$e-$r-$(date -u +%Y%m%d-%H%M%S)"
done; done
want batch_ab && for m in off auto; do
  TRACT_CUDA_BATCH=$m step "gpu_layers_batch_$m" 120 $PY bench/gpu_layers.py --budget-s 60 \
    --name "gpu-layers-batch-$m-$(date -u +%Y%m%d-%H%M%S)"
  TRACT_CUDA_BATCH=$m step "host_profile_213_batch_$m" 100 $PY bench/host_profile.py --blocks 213 \
    --rounds 10
done
# the preset's own budget (570 s) would outlast the step's limit and lose the summary: the
# budget is the limit less the rack's start and the report
want serve_load && step serve_load "${SERVE_LOAD_S:-540}" $PY bench/serve_load.py --size h200 \
  --budget "$(( ${SERVE_LOAD_S:-540} - 40 ))"

ls /dev/shm | grep -c '^tract-' | xargs -I{} echo "tract files left in /dev/shm: {}" >>"$SUMMARY"
log "summary of exit codes:"
fail=0
for k in "${!RC[@]}"; do
  echo "  $k: ${RC[$k]}" | tee -a "$SUMMARY"
  [ "${RC[$k]}" -ne 0 ] && fail=1
done
log "total $(( $(date +%s) - T0 ))s"
finish
exit $fail
