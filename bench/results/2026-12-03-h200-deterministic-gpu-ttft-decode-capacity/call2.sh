#!/usr/bin/env bash
# Device call 2 of session 5: the TTFT rows of both prefill semantics at 32k and 128k (misses,
# staging, prefix hits at window snapshots), the eager-step host time of the per-step attention
# plan, then the GPU tests of what changed (the decode-consistent kernel's deterministic mode,
# deterministic serving under decode-consistent prefill, the planned dispatch) in three processes.
#   BUDGET_S=560 bash bench/results/2026-12-03-h200-deterministic-gpu-ttft-decode-capacity/call2.sh
set -u
source "$(dirname "$0")/common.sh"
step ttft 290 python3 -m oscar_compile.bench.serve --shapes 8b --parts ttft --ttft-contexts 32768 131072 \
  --max-num-batched-tokens 8192 --ttft-new-tokens 512 --out "$R/ttft.json"
step plan_ab 90 python3 -m oscar_compile.bench.serve --shapes 8b --parts decode --contexts 8192 --decode-batches 1 8 \
  --plan-ab --reps 20 --out "$R/plan_ab.json"
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
step tests_kernels 240 $P tests/kernels/test_attention_decode_consistent_triton.py tests/kernels/test_attention_deterministic.py \
  tests/kernels/test_batch_invariance.py &
step tests_deterministic 240 $P -m gpu tests/runtime/test_deterministic_gpu.py tests/runtime/test_deterministic.py &
step tests_plan 240 $P tests/kernels/test_attention_gluon_int8.py tests/kernels/test_attention_gluon.py \
  tests/kernels/test_attention_extend.py tests/kernels/test_attention_plan.py &
wait
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
