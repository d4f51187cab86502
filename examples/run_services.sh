#!/usr/bin/env bash
# The three services by hand (what `tract demo` and Rack do for you), region prefix-cache mode.
# Each prints "TRACT-READY {json}" with its port once it listens; here the ports are fixed.
set -euo pipefail
REGION=/dev/shm/tract-manual-$$
trap 'kill $(jobs -p) 2>/dev/null; wait; rm -f "$REGION"' EXIT
python -m tract_async.serving prefill --mode region-cache --region "$REGION" --create-region \
    --node-id 0 --port 8101 --torch-threads 1 &
python -m tract_async.serving decode --mode region-cache --region "$REGION" \
    --node-id 1 --port 8102 --torch-threads 1 &
wait_up() { curl -sf --retry 60 --retry-connrefused --retry-delay 1 "$1/health" >/dev/null; }
wait_up http://127.0.0.1:8101 && wait_up http://127.0.0.1:8102   # (or read their TRACT-READY)
python -m tract_async.serving router --mode region-cache --port 8100 \
    --prefill-url http://127.0.0.1:8101 --decode-url http://127.0.0.1:8102 &
wait_up http://127.0.0.1:8100
curl -s http://127.0.0.1:8100/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt": "Hello, rack!", "max_tokens": 8}'
echo
curl -sN http://127.0.0.1:8100/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt": "Hello, rack!", "max_tokens": 4, "stream": true}'
curl -s http://127.0.0.1:8101/metrics | grep -E '^tract_(prefix_hit|bytes_moved)'
