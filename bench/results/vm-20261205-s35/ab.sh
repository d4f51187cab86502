#!/usr/bin/env bash
set -u
cd /work/main
envof() { if [ "$1" = new ]; then echo "PYTHONPATH=/work/main NUMBA_CACHE_DIR=/tmp/nbc"; else echo "PYTHONPATH=/tmp/old:/tmp/shim-old NUMBA_CACHE_DIR=/tmp/nbc-old"; fi; }
for i in 1 2; do
  for t in new old; do
    for mb in 16 128; do
      echo "== rprof $mb $t $i"; env $(envof $t) timeout 200 .venv/bin/python .ab/rprof.py $mb $([ $mb = 16 ] && echo 10 || echo 5) 2>&1 | tail -5 | cut -c1-330
    done
  done
done
for i in 1 2; do for t in new old; do
  echo "== tl 64 $t $i"; env $(envof $t) TLPROF=1 timeout 200 .venv/bin/python .ab/tl.py 64 6 2>&1 | grep -E "consumer|handoff"
  echo "== tl 16 $t $i"; env $(envof $t) timeout 200 .venv/bin/python .ab/tl.py 16 10 2>&1 | grep -E "handoff"
done; done
for i in 1 2; do for t in new old; do
  d=/work/main; [ $t = old ] && d=/tmp/old
  (cd $d && env $(envof $t) /work/main/.venv/bin/python bench/putget.py --quick --parts 2 > /tmp/s35/pg-$t-$i.log 2>&1; cp bench/results/putget-quick.json /tmp/s35/putget-quick-p2-$t-$i.json)
  python3 -c "
import json;d=json.load(open('/tmp/s35/putget-quick-p2-$t-$i.json'))
print('== putget $t $i', ' '.join(f\"{r['case']} {r.get('eng_p50_us',0):.0f}/{r.get('shm_p50_us',0):.0f}\" for r in d['handoff']['rows']))"
done; done
