#!/usr/bin/env bash
# One device call for issue #40 (architecture): the GPU tests of the refactored tree, and the
# eager decode rows (host time: plan-once A/B) of this tree against the landed tree 707afb2,
# alternating base / new twice on the same machine. Run from the repository root with .whl
# (the server's wheels) and .carry-base (707afb2 without the bundled model) carried:
#   BUDGET_S=540 bash bench/results/2026-12-05-gpu-architecture-decode-host-time/run.sh
set -u
R=$OUT/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
{ echo "tree: ${TREE:-?}"; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv;
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$R/device.txt" 2>&1
T_END=$(( $(date +%s) + ${BUDGET_S:-540} ))
step() {  # step NAME SECONDS DIR CMD...: in DIR, at most SECONDS and never past T_END; results tarred after each
  local name=$1 limit=$2 dir=$3; shift 3
  local t0=$(date +%s); local left=$(( T_END - t0 - 10 ))
  if [ "$left" -lt 20 ]; then echo "$name skipped: out of time" >> "$R/steps.txt"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "\$ (cd $dir) $*" > "$R/$name.log"
  (cd "$dir" && PYTHONPATH=/tmp/site:$PWD timeout "$limit" "$@") >> "$R/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$(( $(date +%s) - t0 ))s" >> "$R/steps.txt"
  (cd "$OUT" && tar -czf results.tgz r)
}
DECODE="python3 -m oscar_compile.bench.serve --shapes 8b --parts decode --contexts 8192 32768 --decode-batches 1 32 --plan-ab --reps 20"
for i in 1 2; do
  step "decode_base$i" 100 .carry-base $DECODE --out "$R/decode_base$i.json"
  step "decode_new$i" 100 . $DECODE --out "$R/decode_new$i.json"
done
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
step tests_gpu 200 . $P -m gpu tests
step tests_kernels 150 . $P tests/kernels -x
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
