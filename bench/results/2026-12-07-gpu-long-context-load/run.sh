#!/usr/bin/env bash
# Device calls for issue 39's long-context goals: the 64-client load (prompts 16k-32k, outputs
# 512-1024, 300 s, 50 GiB of KV in both modes), one mode per call since one level with its drain
# takes most of a call; then TTFT at 32k and 128k beside the BF16 mode and the 8192-token steps
# profile. From the repository root, .whl carried, TREE the commit as a literal:
#   TREE=<sha> PART=int2|bf16|ttft|tests BUDGET_S=580 bash bench/results/2026-12-07-gpu-long-context-load/run.sh
set -u
R=$OUT/$PART
. bench/results/device_step.sh
case "$PART" in
int2|bf16)  # no warm-up level (it alone would take ~80 s of 64 prompts of 16k-32k): the first 60 s are left
    # out of the steady state instead, which covers the kernels' first compiles
  step load64 570 python3 -m oscar_compile.bench.load --launch random:8b --modes "$PART" --concurrency 64 \
    --duration 300 --prompt-len 16384:32768 --output-len 512:1024 --stream-share 1 --disconnect-share 0 \
    --no-warmup --steady-skip 60 --server-args "--kv-memory 50" --out "$R/load64.json" ;;
ttft)  # TTFT of one 32k and one 128k prompt, INT2 default beside the BF16 mode; the 8192-token steps after the band
    # pre-pass skips the rows without new tokens; the paged prefill and band kernels' GPU tests
  step ttft 240 python3 -m oscar_compile.bench.serve --shapes 8b --parts ttft --kv-memory 40 \
    --ttft-contexts 32768 131072 --ttft-engines consistent+cache --out "$R/ttft.json"
  step steps 150 python3 -m oscar_compile.bench.serve --shapes 8b --parts steps --max-num-batched-tokens 8192 \
    --step-contexts 8192 --step-decodes 31 --reps 3 --out "$R/steps.json"
  step tests_prefill 120 $P -n 4 -m gpu tests/kernels/attention/prefill ;;
tests)  # those GPU tests alone (part ttft's 120 s ran out in the compiles of their float32 cases)
  step tests_prefill 310 $P -n 8 -m gpu --durations=15 tests/kernels/attention/prefill ;;
*) echo "PART must be int2, bf16, ttft or tests" >&2; exit 2 ;;
esac
