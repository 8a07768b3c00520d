#!/usr/bin/env bash
# One device call for issues #30 and #31 (and #32's tests): the GPU tests, the prefill-semantics
# eval at full size, then the structured-output and deterministic bench.serve rows, one at a time.
# Each step has its own limit and the results are tarred after each, so partial results come back.
# Run from the repository root with .whl carried:
#   BUDGET_S=560 bash bench/results/2026-12-03-h200-gpu-tests-structured-deterministic/run.sh
set -u
R=$OUT/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
mkdir -p ~/.cache/oscar_compile && tar -xJf .whl/bpe-151936.tar.xz -C ~/.cache/oscar_compile
{ cat .whl/COMMIT; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv;
  python3 -c "import torch, triton, transformers, importlib.metadata as m; print(torch.__version__, triton.__version__, transformers.__version__, m.version('xgrammar'))"; } > "$R/device.txt" 2>&1
T_END=$(( $(date +%s) + ${BUDGET_S:-560} ))
step() {  # step NAME SECONDS CMD...: at most SECONDS, and never past T_END; results tarred after each
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s); local left=$(( T_END - t0 - 10 ))
  if [ "$left" -lt 20 ]; then echo "$name skipped: out of time" >> "$R/steps.txt"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "\$ $*" > "$R/$name.log"
  timeout "$limit" "$@" >> "$R/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$(( $(date +%s) - t0 ))s" >> "$R/steps.txt"
  (cd "$OUT" && tar -czf results.tgz r)
}
# correctness, side by side (no timing): the GPU-marked tests, the Triton and deterministic tests on
# CUDA, the prefill-semantics eval (a float32 simulation, #31 item 3) and the write's PTX atomics
step gpu_tests 250 python3 -m pytest -q -rs -m gpu --tb=short -p no:cacheprovider tests/runtime/test_structured_output.py \
  tests/runtime/test_parallel_sampling.py tests/runtime/test_prompt_logprobs.py tests/runtime/test_engine.py \
  tests/runtime/test_cuda_graphs.py tests/test_gpu.py tests/kernels/test_attention_gluon_int8.py tests/kernels/test_attention_gluon.py &
step triton_cuda_tests 250 python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/kernels/test_batch_invariance.py \
  tests/kernels/test_attention_deterministic.py tests/runtime/test_deterministic.py tests/kernels/test_cache_write_triton.py \
  tests/kernels/test_code_layout.py tests/kernels/test_attention_extend.py &
step eval_semantics 250 env EVAL_ARGS="--device cuda --dtype float32" OUT="$R/eval" sh eval/results/2026-12-03-cpu-prefill-semantics/run.sh 30 &
step write_ptx 60 python3 -c "
from oscar_compile.kernels.cache_write_triton import compile_offline
ptx = compile_offline(2, 128, 16, 1, 1).asm['ptx']
print('\n'.join(l.strip() for l in ptx.splitlines() if ('atom' in l or 'red.' in l)))" &
wait
# speed, one at a time
step serve_structured 150 python3 -m oscar_compile.bench.serve --shapes 8b --parts structured --structured-batch 32 \
  --structured-prompt 512 --structured-output 128 --out "$R/serve_structured.json"
SERVE="python3 -m oscar_compile.bench.serve --shapes 8b --contexts 8192 --parts decode e2e ttft --e2e-batches 1 32
  --e2e-prompt 1024 --e2e-output 128 --e2e-systems oscar-int2 --ttft-contexts 32768"
step serve_default 75 $SERVE --out "$R/serve_default.json"
step serve_deterministic 75 $SERVE --deterministic --out "$R/serve_deterministic.json"
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
