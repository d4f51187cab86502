#!/usr/bin/env bash
# session 54, call 2: GPU tests (the staged tests' first run in their committed form, the
# whole-line publish under the CUDA poller), then the staged A/B (TRACT_CUDA_STAGE 0/1 x2)
set -u
T0=$(date +%s)
FIN=$OUT; OUT=/tmp/c2out; mkdir -p $OUT
pack() { tar -czf $FIN/c2.tgz -C /tmp c2out; }
export NUMBA_CACHE_DIR=$PWD/.numba_cache
[ -f .ab/numba.txz ] && tar -xJf .ab/numba.txz
git status --short > $OUT/tree-status.txt
export PYTEST_ADDOPTS="--durations=30"
OUT=/tmp/c2out/tests STEPS="warmup gpu_tests" GPU_TESTS_S=220 timeout 330 bash bench/gpu_suite.sh > /dev/null 2>&1
echo "tests rc=$? at $(( $(date +%s) - T0 ))s"; grep -h "passed\|failed\|rc=" $OUT/tests/summary.txt | tail -8; pack
unset PYTEST_ADDOPTS
OUT=/tmp/c2out/stage STEPS="stage_ab" timeout $(( 560 - ($(date +%s) - T0) )) bash bench/gpu_suite.sh > /dev/null 2>&1
echo "stage_ab rc=$? at $(( $(date +%s) - T0 ))s"
mkdir -p $OUT/json; cp bench/results/gpu-layers-stage-*.json $OUT/json/ 2>/dev/null; pack
grep -h "whole prompt\|rc=" $OUT/stage/summary.txt | head -20
