#!/usr/bin/env bash
# A/B of a one-block layer get's metadata (get_meta_1block.py, no copy): the tree before 3ac7424
# (a worktree of 2d8d8ec at $BEFORE, its kernels linked as tract_kernels under $BEFORE_PP)
# against this checkout, alternating. Output: meta_ab.log beside this script.
set -u
D=$(cd "$(dirname "$0")" && pwd)
BEFORE=${BEFORE:-/tmp/s48/wt-before}; BEFORE_PP=${BEFORE_PP:-/tmp/s48/wtb-pp}
for i in 1 2 3 4 5; do
  echo "before $(cd /tmp && PYTHONPATH=$BEFORE:$BEFORE_PP python "$D/get_meta_1block.py" 2>&1 | grep 'per get')"
  echo "after  $(cd /tmp && python "$D/get_meta_1block.py" 2>&1 | grep 'per get')"
done
