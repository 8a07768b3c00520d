#!/usr/bin/env bash
# Device call 1 of session 5, on the landed tree: the timings first, one at a time (the
# structured-output row after the fill fix, the cache write per layer, the int8 kernel's Nsight
# Compute profile at 128k / 1 and 8k / 1), then the GPU tests in three processes.
#   BUDGET_S=570 bash bench/results/2026-12-03-h200-deterministic-gpu-ttft-decode-capacity/call1.sh
set -u
source "$(dirname "$0")/common.sh"
step serve_structured 180 python3 -m oscar_compile.bench.serve --shapes 8b --parts structured --structured-batch 32 \
  --structured-prompt 512 --structured-output 128 --out "$R/serve_structured.json"
step write 60 python3 -m oscar_compile.bench.kernels --parts write write-variants --out "$R/write.json"
NCU="ncu --clock-control none --kernel-name regex:_decode_int8_kernel --launch-skip 1 --launch-count 1
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy
  --metrics regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"
step ncu_131072x1 60 $NCU python3 -m oscar_compile.bench.kernels --profile 131072 1 int8
step ncu_8192x1 45 $NCU python3 -m oscar_compile.bench.kernels --profile 8192 1 int8
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
step tests_dc_kernel 300 $P tests/kernels/test_attention_decode_consistent_triton.py tests/kernels/test_cache_write_triton.py &
step tests_int8 300 $P tests/kernels/test_attention_gluon_int8.py &
step tests_runtime 300 $P -m gpu tests/runtime/test_cuda_graphs.py tests/runtime/test_engine.py tests/runtime/test_deterministic.py \
  tests/runtime/test_prompt_logprobs.py &
wait
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
