#!/usr/bin/env bash
# Device call 3 of session 5: the structured-output row again (its batch-32 TTFT after the batched
# decode-consistent views), the decode and capacity rows of the 8B and 4B shapes on the int8
# kernel, then the GPU tests the second call's time cut (the decode-consistent kernel's aligned
# blocks across chunkings on CUDA) and the int8 kernel's tests, beside each other.
#   BUDGET_S=470 bash bench/results/2026-12-03-h200-deterministic-gpu-ttft-decode-capacity/call3.sh
set -u
source "$(dirname "$0")/common.sh"
step serve_structured 150 python3 -m oscar_compile.bench.serve --shapes 8b --parts structured --structured-batch 32 \
  --structured-prompt 512 --structured-output 128 --out "$R/serve_structured.json"
step serve_capacity 230 python3 -m oscar_compile.bench.serve --shapes 8b 4b --contexts 131072 --capacity-contexts 100000 \
  --kv-memory 80 --reps 5 --parts decode capacity --out "$R/serve_capacity.json"
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
step tests_dc_aligned 150 $P tests/kernels/test_attention_decode_consistent_triton.py -k "(deterministic_rows and cuda) or attention_deterministic" \
  tests/kernels/test_attention_deterministic.py &
step tests_int8 150 $P tests/kernels/test_attention_gluon_int8.py &
wait
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
