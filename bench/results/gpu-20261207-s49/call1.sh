set -u
cd "$(dirname "$0")/.."
export R=$OUT
for t in 785a8b9:old.tgz 0cc95f0:t-0cc95f0.tgz b55e4d2:t-b55e4d2.tgz; do c=${t%%:*}; f=${t#*:}
  rm -rf /tmp/tr-$c && mkdir -p /tmp/tr-$c /tmp/pp-$c && tar -xzf .ab/$f -C /tmp/tr-$c && ln -sfn /tmp/tr-$c/kernels /tmp/pp-$c/tract_kernels; done
export NUMBA_CACHE_DIR=$PWD/.numba_cache; mkdir -p $NUMBA_CACHE_DIR; tar -xzf .ab/numba.tgz -C $NUMBA_CACHE_DIR
for c in 785a8b9 0cc95f0 b55e4d2; do (NUMBA_CACHE_DIR=/tmp/nc-old PYTHONPATH=/tmp/tr-$c:/tmp/pp-$c:/tmp/site-nixl timeout 200 python -m tract_async.tools.warmup > $R/warm-$c.log 2>&1; echo "warm $c rc=$? $(date +%T)" >> $R/warm-$c.log) & done
T0=$(date +%s)
bash .ab/call.sh "warmup gpu_tests" \
 "for i in \$(seq 200); do [ \$(cat \$R/warm-*.log | grep -c '^warm ') -ge 3 ] && break; sleep 1; done; echo warmups done after \$(( \$(date +%s) - $T0 ))s; tail -n1 \$R/warm-*.log" \
 "for k in 1 2; do for sw in 11 00 10; do TRACT_CUDA_LAYER_STREAMS=\${sw:0:1} TRACT_CUDA_POLL_DUE=\${sw:1:1} timeout 60 python bench/gpu_layers.py --sections layer_ops --blocks 1 32 213 1024 --budget-s 40 --name lo-streams\$sw-\$k > \$R/lo_s\${sw}_\$k.log 2>&1; echo \"== streams=\$sw \$k rc=\$?\"; grep -E 'host cost|blocks vs raw' \$R/lo_s\${sw}_\$k.log; cp bench/results/lo-streams\$sw-\$k.json \$R/; done; done" \
 "for k in 1; do for c in HEAD 785a8b9 0cc95f0 b55e4d2; do if [ \$c = HEAD ]; then PP=\$PYTHONPATH; GC=\$(cat .ab/commit); else PP=/tmp/tr-\$c:/tmp/pp-\$c:/tmp/site-nixl; GC=\$c; fi; NC=\$NUMBA_CACHE_DIR; [ \$c = HEAD ] || NC=/tmp/nc-old; NUMBA_CACHE_DIR=\$NC PYTHONPATH=\$PP TRACT_GIT_COMMIT=\$GC timeout 50 python bench/gpu_layers.py --sections whole_prompt --budget-s 35 --name wp-\$c-\$k > \$R/wp_\${c}_\$k.log 2>&1; echo \"== \$c \$k rc=\$?\"; grep -A3 'split_put' \$R/wp_\${c}_\$k.log | head -4; grep -E 'whole' \$R/wp_\${c}_\$k.log | grep -E 'MISS|PASS'; cp bench/results/wp-\$c-\$k.json \$R/ 2>/dev/null; done; done" \
 "timeout 120 python bench/gpu_layers.py --budget-s 100 --name gpu-layers-acceptance-s49 > \$R/acc.log 2>&1; echo acc rc=\$?; grep -E 'MISS|PASS' \$R/acc.log; cp bench/results/gpu-layers-acceptance-s49.json \$R/" \
 "timeout 90 python bench/host_profile.py --blocks 1024 > \$R/hp1024.log 2>&1; echo hp1024 rc=\$?; tail -5 \$R/hp1024.log" \
 "cd \$R && tar czf all.tgz *.log *.json && rm -f *.log *.json; cd - >/dev/null"
