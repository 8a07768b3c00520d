#!/usr/bin/env bash
# Device call 3 of session 4, on the merged tree: the GPU tests (kernels, deterministic mode,
# runtime, decode-consistent prefill) and the perplexity through the int8 kernel side by side,
# then the timings one at a time: the structured-output row, the attention table and the write,
# the deterministic serve rows against the default, decode-consistent prefill at 32k, the matmul tiles.
# (the default rows are call 1's: ../2026-12-03-h200-gpu-tests-structured-deterministic/)
#   BUDGET_S=390 bash bench/results/2026-12-03-h200-deterministic-serving-matmul-int8-ppl/call3.sh
set -u
source "$(dirname "$0")/common.sh"
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
step kernel_tests_a 120 $P tests/kernels/test_attention_gluon_int8.py tests/kernels/test_attention_decode_consistent_triton.py &
step kernel_tests_b 120 $P tests/kernels/test_batch_invariance.py tests/kernels/test_attention_deterministic.py \
  tests/kernels/test_cache_write_triton.py tests/kernels/test_code_layout.py tests/kernels/test_decode_bits.py \
  tests/kernels/test_attention_triton.py &
step runtime_gpu_tests 120 $P -m gpu tests/runtime/test_prompt_logprobs.py tests/runtime/test_deterministic.py \
  tests/runtime/test_decode_consistent_prefill.py tests/runtime/test_cuda_graphs.py &
step decode_ppl 120 python3 -m oscar_compile.bench.decode_ppl --context 4096 --num-samples 64 --scored 256 \
  --batch-size 64 --kernels triton auto --out "$R/decode_ppl.json" &
wait
step serve_structured 100 python3 -m oscar_compile.bench.serve --shapes 8b --parts structured --structured-batch 32 \
  --structured-prompt 512 --structured-output 128 --out "$R/serve_structured.json"
step kernels 60 python3 -m oscar_compile.bench.kernels --parts attention \
  --shapes 8192x1 32768x32 131072x1 --out "$R/kernels.json"
SERVE="python3 -m oscar_compile.bench.serve --shapes 8b --contexts 8192 --parts decode e2e ttft --e2e-batches 1 32
  --e2e-prompt 1024 --e2e-output 128 --e2e-systems oscar-int2 --ttft-contexts 32768"
step serve_deterministic 90 $SERVE --deterministic --out "$R/serve_deterministic.json"
step dc_prefill 50 python3 -m oscar_compile.bench.decode_consistent --shapes 0:32768 30720:2048 --out "$R/dc_prefill.json"
step matmul_tiles 45 python3 "$(dirname "$0")/matmul_tiles.py" "$R/matmul_tiles.json"
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
