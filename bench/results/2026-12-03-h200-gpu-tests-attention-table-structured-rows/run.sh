#!/usr/bin/env bash
# One device call on the merged tree (issues #30, #31, #32): the GPU tests first, then the
# benchmarks, each step under its own time limit so that a slow one cannot take the others' time.
# Run from the repository root with .whl carried: bash bench/results/2026-12-03-h200-gpu-tests-attention-table-structured-rows/run.sh
set -u
R=$OUT/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
mkdir -p ~/.cache/oscar_compile && tar -xJf .whl/bpe-151936.tar.xz -C ~/.cache/oscar_compile
{ cat .whl/COMMIT; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv;
  python3 -c "import torch, triton, transformers, xgrammar; print(torch.__version__, triton.__version__, transformers.__version__, xgrammar.__version__)"; } > "$R/device.txt" 2>&1
T_END=$(( $(date +%s) + ${BUDGET_S:-360} ))  # every step ends by then, so the results always come back
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
# correctness: the GPU-marked tests and the Triton kernels on CUDA, side by side (no timing yet)
step gpu_tests 120 python3 -m pytest -q -rs -m gpu tests/kernels/test_attention_gluon_int8.py tests/kernels/test_attention_gluon.py \
  tests/runtime/test_structured_output.py tests/runtime/test_parallel_sampling.py tests/runtime/test_prompt_logprobs.py \
  tests/runtime/test_engine.py tests/runtime/test_cuda_graphs.py tests/test_gpu.py &
step triton_cuda_tests 120 python3 -m pytest -q -rs -p no:cacheprovider tests/kernels/test_cache_write_triton.py tests/kernels/test_code_layout.py \
  tests/kernels/test_attention_extend.py tests/kernels/test_batch_invariance.py tests/kernels/test_attention_deterministic.py \
  tests/runtime/test_deterministic.py &
wait
# speed, one at a time
step kernels 90 python3 -m oscar_compile.bench.kernels --parts attention write --out "$R/kernels.json"
step serve_structured 80 python3 -m oscar_compile.bench.serve --shapes 8b --parts structured --structured-batch 32 \
  --structured-prompt 512 --structured-output 128 --out "$R/serve_structured.json"
step serve_decode_default 45 python3 -m oscar_compile.bench.serve --shapes 8b --contexts 8192 131072 --parts decode --out "$R/serve_decode_default.json"
step serve_decode_deterministic 45 python3 -m oscar_compile.bench.serve --shapes 8b --contexts 8192 131072 --parts decode --deterministic --out "$R/serve_decode_deterministic.json"
cd "$OUT" && tar -czf results.tgz r && rm -rf r && cat r 2>/dev/null; tar -xzOf results.tgz r/steps.txt
