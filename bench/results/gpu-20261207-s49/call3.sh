set -u
cd "$(dirname "$0")/.."
export R=$OUT
export NUMBA_CACHE_DIR=$PWD/.numba_cache; mkdir -p $NUMBA_CACHE_DIR; tar -xJf .ab/numba.txz -C $NUMBA_CACHE_DIR
bash .ab/call.sh "warmup gpu_tests" \
 "for k in 1 2; do for sw in 1 0; do TRACT_CUDA_STAGES=\$sw timeout 50 python bench/gpu_layers.py --sections whole_prompt --budget-s 35 --name wp-stages\$sw-\$k > \$R/wp_st\${sw}_\$k.log 2>&1; echo \"== stages=\$sw \$k rc=\$?\"; grep -A3 'split_put' \$R/wp_st\${sw}_\$k.log | head -4; grep -E 'whole' \$R/wp_st\${sw}_\$k.log | grep -E 'MISS|PASS'; cp bench/results/wp-stages\$sw-\$k.json \$R/; done; done" \
 "timeout 100 python bench/host_profile.py --blocks 1024 --rounds 6 > \$R/hp1024.log 2>&1; echo hp1024 rc=\$?; head -3 \$R/hp1024.log; grep -i evicted \$R/hp1024.log | head -3" \
 "cd \$R && tar czf all.tgz *.log *.json && rm -f *.log *.json; cd - >/dev/null" \
 "rm -f \$R/numba.tgz"
