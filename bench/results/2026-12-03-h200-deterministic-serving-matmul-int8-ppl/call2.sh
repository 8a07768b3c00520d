#!/usr/bin/env bash
# Device call 2 of session 4: the GPU tests that failed or did not run in call 1 (prompt logprobs
# on the GPU path, CUDA graphs, the split-K matmul's rows), then the split-K matmul against cuBLAS,
# the structured-output row after the one-thread fill, and the perplexity through the int8 kernel.
#   BUDGET_S=400 bash bench/results/2026-12-03-h200-deterministic-serving-matmul-int8-ppl/call2.sh
set -u
source "$(dirname "$0")/common.sh"
step gpu_tests 150 python3 -m pytest -q -rs -m gpu --tb=short -p no:cacheprovider tests/runtime/test_prompt_logprobs.py \
  tests/runtime/test_cuda_graphs.py &
step matmul_tests 150 python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/kernels/test_batch_invariance.py &
wait
step matmul_split 60 python3 "$(dirname "$0")/matmul_split.py" "$R/matmul_split.json"
step serve_structured 110 python3 -m oscar_compile.bench.serve --shapes 8b --parts structured --structured-batch 32 \
  --structured-prompt 512 --structured-output 128 --out "$R/serve_structured.json"
step decode_ppl 60 python3 -m oscar_compile.bench.decode_ppl --context 4096 --num-samples 64 --scored 256 \
  --kernels triton auto --out "$R/decode_ppl.json"
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
