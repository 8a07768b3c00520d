#!/usr/bin/env bash
# Device calls for the prefill issue (#39), after call 29's step profile (INT2's 8192-token step:
# attention at parity with the BF16 mode, the cache write 32 ms and the rotated RoPE 16 ms of 286 ms,
# against 0.7 and 3.4 ms): the write and RoPE kernels, the memory plan's GPU test, the step profile,
# and end to end in both modes. From the repository root, .whl carried (pydantic, pytest-xdist,
# pytest-instafail, fastapi, ...), TREE the commit as a literal:
#   TREE=<sha> PART=a BUDGET_S=420 bash bench/results/2026-12-07-gpu-int2-prefill-step/run.sh
set -u
R=$OUT/r$PART
. bench/results/device_step.sh  # the helper these calls ran inline, moved there unchanged
E2E="python3 -m oscar_compile.bench.serve --shapes 8b --parts e2e --e2e-batches 1 32 --e2e-prompt 8192 --e2e-output 256 --e2e-kv-memory 60 --max-num-batched-tokens 8192"
case "$PART" in
a)  # the write and RoPE variants (a prototype beside the tree, not kept: its output is calla/), the write under
    # Nsight Compute, the memory plan's test with its failure printed as it happens
  step probe 150 python3 proto_write_rope.py "$R/probe.json"
  step ncu_write 90 ncu --kernel-name regex:_cache_write_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
    python3 proto_write_rope.py ncu
  step tests_rope 60 $P tests/kernels/elementwise tests/test_gpu.py -k "rope or elementwise"
  step tests_memory 170 $P -x -v -s --instafail -m gpu tests/runtime/worker/test_memory_profile.py -k decode ;;
b)  # RoPE's rotation on the tensor cores (bf16x3) and the steps profile on distinct pages: the rotation's
    # tilings (call b ran the prototype that became bench.rope), its GPU tests, end to end at the command in both modes (at the largest whole GiB that fits if the start
    # refuses 60), the 8192-token steps kernel by kernel
  step rope_sweep 100 python3 -m oscar_compile.bench.rope --out "$R/rope_sweep.json"
  step tests_rope 100 $P -n 4 tests/kernels/elementwise tests/test_gpu.py -k "rope or fused_elementwise"
  step e2e 320 $E2E --e2e-systems oscar-int2 oscar-bf16 --e2e-time-limit 150 --out "$R/e2e.json"
  FIT=$(grep -ho "kv-memory [0-9.]* would fit" "$R/e2e.json" "$R/e2e.log" 2>/dev/null | awk '{print int($2)}' | sort -n | head -1)
  if [ -n "$FIT" ]; then
    step e2e_fit 220 ${E2E/--e2e-kv-memory 60/--e2e-kv-memory $FIT} --e2e-systems oscar-int2 oscar-bf16 \
      --e2e-time-limit 90 --out "$R/e2e_fit.json"
  fi
  step steps 130 python3 -m oscar_compile.bench.serve --shapes 8b --parts steps --max-num-batched-tokens 8192 \
    --step-contexts 8192 --step-decodes 31 --reps 3 --out "$R/steps.json" ;;
c)  # the memory plan's test without the allocator's limit, TTFT at 32k beside the BF16 mode, the memory test
    # with expandable segments
  step tests_memory 170 $P -x -v -s --instafail -m gpu tests/runtime/worker/test_memory_profile.py -k decode
  step ttft 150 python3 -m oscar_compile.bench.serve --shapes 8b --parts ttft --kv-memory 40 --ttft-contexts 32768 \
    --ttft-engines consistent+cache --out "$R/ttft.json"
  step tests_memory_expandable 170 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $P -x -v -s --instafail -m gpu \
    tests/runtime/worker/test_memory_profile.py -k decode ;;
d)  # the memory plan's test, prompt-exact, with expandable segments and without; deterministic mode
  step tests_memory_exact_expandable 150 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $P -x -v -s --instafail \
    -m gpu tests/runtime/worker/test_memory_profile.py -k prompt
  step tests_deterministic 80 $P -m gpu tests/runtime/test_deterministic_gpu.py
  step tests_memory_exact 150 $P -x -v -s --instafail -m gpu tests/runtime/worker/test_memory_profile.py -k prompt ;;
esac
