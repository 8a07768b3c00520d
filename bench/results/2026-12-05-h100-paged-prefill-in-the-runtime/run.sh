#!/usr/bin/env bash
# Device calls for issue #39 (the paged decode-consistent prefill wired into the runtime): the GPU
# tests of the kernel and the runtime, the kernel rows (with a tile sweep), and the end-to-end rows
# of INT2 and the BF16 mode on this tree and on the landed tree 707afb2 (.carry-base), one after
# the other on one machine. Run from the repository root with .carry-base carried:
#   PART=1 BUDGET_S=560 bash bench/results/2026-12-05-h100-paged-prefill-in-the-runtime/run.sh
#   PART=2 ...   (the TTFT rows of both trees, then the remaining GPU tests)
set -u
HERE=bench/results/2026-12-05-h100-paged-prefill-in-the-runtime
R=$OUT/r$PART; mkdir -p "$R"
{ echo "tree: $(cat .tree 2>/dev/null || echo '?')"; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv;
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$R/device.txt" 2>&1
T_END=$(( $(date +%s) + ${BUDGET_S:-560} ))
step() {  # step NAME SECONDS DIR CMD...: in DIR, at most SECONDS and never past T_END; results tarred after each
  local name=$1 limit=$2 dir=$3; shift 3
  local t0=$(date +%s); local left=$(( T_END - t0 - 10 ))
  if [ "$left" -lt 20 ]; then echo "$name skipped: out of time" >> "$R/steps.txt"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "\$ (cd $dir) $*" > "$R/$name.log"
  (cd "$dir" && PYTHONPATH=$PWD timeout "$limit" "$@") >> "$R/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$(( $(date +%s) - t0 ))s" >> "$R/steps.txt"
  (cd "$OUT" && tar -czf results$PART.tgz r$PART)
}
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
E2E="python3 -m oscar_compile.bench.serve --shapes 8b --parts e2e --e2e-batches 1 32 --e2e-prompt 8192 --e2e-output 256 --e2e-kv-memory 60 --max-num-batched-tokens 8192 --e2e-systems oscar-int2 oscar-bf16 --e2e-time-limit 100"
TTFT="python3 -m oscar_compile.bench.serve --shapes 8b --parts ttft --ttft-contexts 32768 131072 --kv-memory 40"
if [ "$PART" = 1 ]; then
  step tests_kernel 150 . $P -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py \
    tests/runtime/worker/test_cuda_graphs.py tests/runtime/test_deterministic_gpu.py
  step kernel 60 . python3 -m oscar_compile.bench.prefill_paged --contexts 8192 32768 131072 --reps 5 --no-old \
    --out "$R/prefill_paged.json"
  step sweep 50 . python3 $HERE/tile_sweep.py 32768 "$R/sweep.json"
  step e2e_new 150 . $E2E --out "$R/e2e_new.json"
  step e2e_base 150 .carry-base $E2E --out "$R/e2e_base.json"
else
  step ttft_new 200 . $TTFT --out "$R/ttft_new.json"
  step ttft_base 200 .carry-base $TTFT --out "$R/ttft_base.json"
  step tests_rest 150 . $P -m gpu tests --ignore=tests/runtime/server --ignore=tests/test_assembly.py \
    --ignore=tests/runtime/structured_output --ignore=tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py \
    --ignore=tests/runtime/worker/test_cuda_graphs.py --ignore=tests/runtime/test_deterministic_gpu.py
fi
cd "$OUT" && tar -czf results$PART.tgz r$PART && rm -rf r$PART; tar -xzOf results$PART.tgz r$PART/steps.txt
