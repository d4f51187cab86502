#!/usr/bin/env bash
# session 54, call 1: line-publish micro-bench; warm-up; layer ops new (whole-line publish) /
# prev (d36ff1d) alternating x2; acceptance run (new)
set -u
T0=$(date +%s)
FIN=$OUT; OUT=/tmp/c1out; mkdir -p $OUT
pack() { tar -czf $FIN/c1.tgz -C /tmp c1out; }
export NUMBA_CACHE_DIR=$PWD/.numba_cache
SHIM=/tmp/tract-pypath; mkdir -p $SHIM; ln -sfn $PWD/kernels $SHIM/tract_kernels
export PYTHONUNBUFFERED=1
git status --short > $OUT/tree-status.txt; git diff --stat >> $OUT/tree-status.txt
mkdir -p /tmp/prev/pp && tar -xzf .ab/prev.tgz -C /tmp/prev && ln -sfn /tmp/prev/kernels /tmp/prev/pp/tract_kernels
(cd /tmp/prev && NUMBA_CACHE_DIR=/tmp/prev-numba PYTHONPATH=/tmp/prev:/tmp/prev/pp timeout 200 python -m tract_async.tools.warmup > $OUT/warm-prev.log 2>&1 &)
PYTHONPATH="$PWD:$SHIM" timeout 60 python bench/line_publish.py > $OUT/line_publish.log 2>&1
echo "line_publish rc=$? at $(( $(date +%s) - T0 ))s"; cp bench/results/line-publish-*.json $OUT/; pack
OUT=/tmp/c1out/suite STEPS="warmup" timeout 200 bash bench/gpu_suite.sh > /dev/null 2>&1
echo "warmup rc=$? at $(( $(date +%s) - T0 ))s"; pack
export PYTHONPATH="$PWD:$SHIM:/tmp/site-nixl"
lo() {  # lo TAG DIR CACHE ROUND
  local tag=$1 dir=$2 cache=$3
  (cd $dir && NUMBA_CACHE_DIR=$cache PYTHONPATH=$dir:$( [ $dir = $PWD ] && echo $SHIM || echo /tmp/prev/pp ):/tmp/site-nixl \
    timeout 90 python bench/gpu_layers.py --sections layer_ops --blocks 1 32 213 1024 --budget-s 70 \
    --name lo-$tag-$4-$RANDOM --out-dir $OUT > $OUT/lo-$tag.log.$4 2>&1)
  echo "lo $tag $4 rc=$? at $(( $(date +%s) - T0 ))s"; pack
}
for r in 1 2; do
  [ $(( $(date +%s) - T0 )) -lt 400 ] && lo new $PWD $NUMBA_CACHE_DIR $r
  [ $(( $(date +%s) - T0 )) -lt 420 ] && lo prev /tmp/prev /tmp/prev-numba $r
done
[ $(( $(date +%s) - T0 )) -lt 430 ] && timeout $(( 575 - ($(date +%s) - T0) )) python bench/gpu_layers.py --budget-s 120 --name acc-new --out-dir $OUT > $OUT/acc.log 2>&1
echo "acc rc=$? at $(( $(date +%s) - T0 ))s"; pack
tar -cJf $FIN/numba.txz .numba_cache 2>/dev/null
echo "done at $(( $(date +%s) - T0 ))s"; pack; ls $OUT
