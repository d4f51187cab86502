#!/bin/bash
# X = 159377d (int site ids: per-site literal compiles), Y = working tree (np.int64 site ids); alternating; no boundscheck
source /tmp/mv/bin/activate
out=/tmp/s52/sites
mkdir -p $out
for i in 1 2 3 4; do
  for v in X Y; do
    if [ $v = X ]; then cd /tmp/s52/wt; PP=/tmp/s52/pp:/tmp/s52/wt; C=/tmp/nc-X; else cd /work/main; PP=; C=/tmp/nc-Y; fi
    PYTHONPATH=$PP NUMBA_CACHE_DIR=$C python bench/kernels.py --quick > $out/kernels-$v$i.txt 2>&1
    PYTHONPATH=$PP NUMBA_CACHE_DIR=$C python bench/putget.py --quick --no-nixl --parts 13 > $out/putget-$v$i.txt 2>&1
  done
done
echo ALLDONE
