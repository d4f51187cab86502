#!/bin/bash
# A = main (inline="always"), B = worktree (inline="never"); alternating; no boundscheck
source /tmp/mv/bin/activate
out=/tmp/s52/ac
mkdir -p $out
for i in 1 2 3 4; do
  for v in A C; do
    if [ $v = A ]; then cd /work/main; PP=; C=/tmp/nc-A; else cd /tmp/s52/wt; PP=/tmp/s52/pp:/tmp/s52/wt; C=/tmp/nc-C; fi
    PYTHONPATH=$PP NUMBA_CACHE_DIR=$C python bench/kernels.py --quick > $out/kernels-$v$i.txt 2>&1
    PYTHONPATH=$PP NUMBA_CACHE_DIR=$C python bench/putget.py --quick --no-nixl --parts 13 > $out/putget-$v$i.txt 2>&1
  done
done
echo ALLDONE
