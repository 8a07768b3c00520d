#!/usr/bin/env bash
# Device calls for the prefill issue (#39): the paged decode-consistent prefill in the runtime and
# window snapshots taken inside chunks. The GPU tests of what changed, the kernel rows, and the
# end-to-end and TTFT rows of the INT2 mode and the BF16 mode, on this tree and on the landed tree
# 707afb2 (.carry-base: its tree without the bundled model), one after the other on one machine.
# From the repository root, .carry-base and .whl (the wheels the device lacks: pydantic, pytest-xdist,
# and the server's fastapi, starlette, uvicorn and opentelemetry-api) carried, TREE the commit as a literal (git on the device does not see the session's):
#   TREE=<sha> PART=1 BUDGET_S=570 bash bench/results/2026-12-05-gpu-int2-prefill-end-to-end/run.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
R=$OUT/r$PART; mkdir -p "$R"
{ echo "tree: ${TREE:-?} (base: 707afb2)"; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv;
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$R/device.txt" 2>&1
T_END=$(( $(date +%s) + ${BUDGET_S:-570} ))
step() {  # step NAME SECONDS DIR CMD...: in DIR, at most SECONDS and never past T_END; results tarred after each
  local name=$1 limit=$2 dir=$3; shift 3
  local t0=$(date +%s); local left=$(( T_END - t0 - 10 ))
  if [ "$left" -lt 20 ]; then echo "$name skipped: out of time" >> "$R/steps.txt"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "\$ (cd $dir) $*" > "$R/$name.log"
  (cd "$dir" && PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD timeout "$limit" "$@") >> "$R/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$(( $(date +%s) - t0 ))s" >> "$R/steps.txt"
  (cd "$OUT" && tar -czf results$PART.tgz r$PART)
}
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
E2E="python3 -m oscar_compile.bench.serve --shapes 8b --parts e2e --e2e-batches 1 32 --e2e-prompt 8192 --e2e-output 256 --e2e-kv-memory 60 --max-num-batched-tokens 8192"
TTFT="python3 -m oscar_compile.bench.serve --shapes 8b --parts ttft --kv-memory 40"
case "$PART" in
3)  # bundled model stashed (tree, .whl and .carry-base within 64 MiB); .whl brings pytest-xdist
  step e2e_new 170 . $E2E --e2e-systems oscar-int2 oscar-bf16 --e2e-time-limit 100 --out "$R/e2e_new.json"
  step tests_gpu 140 . $P -n 8 -m gpu tests/kernels/attention/prefill tests/cache tests/runtime/worker \
    --ignore tests/runtime/worker/test_memory_profile.py
  step e2e_base 130 .carry-base $E2E --e2e-systems oscar-int2 --e2e-time-limit 100 --out "$R/e2e_base.json"
  step kernel 40 . python3 -m oscar_compile.bench.prefill_paged --contexts 8192 32768 131072 --reps 5 --out "$R/prefill_paged.json"
  step memory_profile 60 . $P -m gpu tests/runtime/worker/test_memory_profile.py ;;  # alone: it reads free memory
5)  # after part 3: batch 32 with the workload's warm-up and compiles logged, the GPU tests' failures, TTFT at 32k
  step e2e_b32 170 . ${E2E/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 --out "$R/e2e_b32.json"
  step tests_gpu 110 . $P -n 8 -v --maxfail 3 -m gpu tests/kernels/attention/prefill tests/cache tests/runtime/worker \
    --ignore tests/runtime/worker/test_memory_profile.py
  step ttft_new 160 . $TTFT --ttft-contexts 32768 --ttft-engines consistent consistent+cache --out "$R/ttft_new.json" ;;
6)  # the last minutes: the GPU tests of part 3, each failure printed as it happens (.whl: pytest-instafail)
  step tests_gpu 130 . $P -n 8 --instafail -m gpu tests/kernels/attention/prefill tests/cache tests/runtime/worker \
    --ignore tests/runtime/worker/test_memory_profile.py ;;
7)  # the next session's first call (bundled model carried, no .carry-base): the failures by name, the
    # issue's small mixed step (32 decodes beside 512 prefill tokens) in both modes, TTFT at 128k
  step tests_gpu 150 . $P -n 8 --instafail -m gpu tests/kernels/attention/prefill tests/cache tests/runtime/worker \
    tests/runtime/test_deterministic_gpu.py --ignore tests/runtime/worker/test_memory_profile.py
  SMALL=${E2E/--max-num-batched-tokens 8192/--max-num-batched-tokens 544}
  step e2e_small_chunks 150 . ${SMALL/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 \
    --out "$R/e2e_small_chunks.json"
  step ttft_128k 200 . $TTFT --ttft-contexts 131072 --ttft-engines consistent+cache --out "$R/ttft_128k.json" ;;
10) # piecewise CUDA graphs of mixed steps: the GPU tests (engines sharing the device by conftest), then
    # the small mixed step (32 decodes beside 512 prefill tokens) in both modes
  step tests_gpu 200 . $P -n 4 --instafail -m gpu tests/runtime/worker/test_cuda_graphs.py tests/kernels/attention/prefill \
    tests/cache tests/runtime/worker tests/runtime/test_deterministic_gpu.py --ignore tests/runtime/worker/test_memory_profile.py
  SMALL=${E2E/--max-num-batched-tokens 8192/--max-num-batched-tokens 544}
  step e2e_small_chunks 260 . ${SMALL/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 \
    --e2e-time-limit 90 --out "$R/e2e_small_chunks.json" ;;
11) # the CUDA-graph tests by name (piecewise included), the default token budget (2048: every step of
    # the batch-32 run replays piecewise graphs) in both modes, then the GPU tests part 10 did not reach
  step tests_graphs 120 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  MID=${E2E/--max-num-batched-tokens 8192/--max-num-batched-tokens 2048}
  step e2e_default_budget 190 . ${MID/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 \
    --e2e-time-limit 70 --out "$R/e2e_default_budget.json"
  step tests_gpu 200 . $P -n 4 --instafail -m gpu tests/kernels/attention/prefill tests/cache tests/runtime/test_deterministic_gpu.py \
    tests/runtime/worker/test_prompt_logprobs.py tests/runtime/worker/test_decode_consistent_prefill.py ;;
12) # the session's last call: batch 32 at a 544-token budget in both modes (piecewise graphs, the row
    # views and the per-step offsets), the CUDA-graph tests by name, then where INT2's host time
    # goes in those mixed steps (cProfile: the Python of the eager attention between the pieces)
  SMALL=${E2E/--max-num-batched-tokens 8192/--max-num-batched-tokens 544}
  step e2e_small_chunks 200 . ${SMALL/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 \
    --e2e-time-limit 90 --out "$R/e2e_small_chunks.json"
  step tests_graphs 100 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  step profile_int2 130 . python3 -m cProfile -o "$R/int2_small_chunks.prof" -m oscar_compile.bench.serve --shapes 8b \
    --parts e2e --e2e-batches 32 --e2e-prompt 8192 --e2e-output 32 --e2e-kv-memory 60 --max-num-batched-tokens 544 \
    --e2e-systems oscar-int2 --out "$R/e2e_profiled.json" ;;
14) # the next session's first call (TREE given as a literal: the device's .git is not the session's):
    # INT2 and the BF16 mode at the 544-token budget with the ops called directly between the pieces
    # (unmeasured), the CUDA-graph tests by name, then the kernel / cache / worker GPU tests
  SMALL=${E2E/--max-num-batched-tokens 8192/--max-num-batched-tokens 544}
  step e2e_small_chunks 200 . ${SMALL/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 \
    --e2e-time-limit 90 --out "$R/e2e_small_chunks.json"
  step tests_graphs 90 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  step tests_gpu 200 . $P -n 4 --instafail -m gpu tests/cache tests/runtime/worker tests/runtime/test_deterministic_gpu.py \
    tests/kernels/attention/prefill --ignore tests/runtime/worker/test_memory_profile.py \
    --ignore tests/runtime/worker/test_cuda_graphs.py ;;
15) # the stored history's partial (history_partial_triton) in the paged op: its GPU tests, the tiles
    # sweep at 32k (the old folded loop first, in the same run) and the kernel rows, then TTFT of both modes
  step tests_kernel 110 . $P -n 4 --instafail -m gpu tests/kernels/attention/prefill
  step kernel 190 . python3 -m oscar_compile.bench.prefill_paged --sweep --contexts 8192 32768 131072 --reps 5 \
    --out "$R/prefill_paged.json"
  step ttft 250 . $TTFT --ttft-contexts 32768 131072 --ttft-engines consistent+cache --out "$R/ttft.json" ;;
16) # after part 15: end to end at the 8192-token budget (batches 1 and 32) and at 544 (batch 32),
    # both modes, then the CUDA-graph and the other GPU tests
  step e2e 230 . $E2E --e2e-systems oscar-int2 oscar-bf16 --e2e-time-limit 90 --out "$R/e2e.json"
  SMALL=${E2E/--max-num-batched-tokens 8192/--max-num-batched-tokens 544}
  step e2e_small_chunks 170 . ${SMALL/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 \
    --e2e-time-limit 70 --out "$R/e2e_small_chunks.json"
  step tests_graphs 90 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  step tests_gpu 200 . $P -n 4 --instafail -m gpu tests/cache tests/runtime/worker tests/runtime/test_deterministic_gpu.py \
    --ignore tests/runtime/worker/test_memory_profile.py --ignore tests/runtime/worker/test_cuda_graphs.py ;;
17) # the 8192-token budget's OOM (call 16) fixed: piecewise warm-ups' blocks released before the capture,
    # --kv-memory checked by a profile run. End to end at the command (60 GiB), and at the largest
    # whole GiB that fits if the start refuses 60; then the memory plan's GPU test, the CUDA-graph tests (an aborted capture
    # included), the history tiles swept at 32k and the kernel rows at 32k / 128k (vs_ref), and the paged prefill kernel's GPU tests
  step e2e 320 . $E2E --e2e-systems oscar-int2 oscar-bf16 --e2e-time-limit 150 --out "$R/e2e.json"
  FIT=$(grep -ho "kv-memory [0-9.]* would fit" "$R/e2e.json" "$R/e2e.log" 2>/dev/null | awk '{print int($2)}' | sort -n | head -1)
  if [ -n "$FIT" ]; then  # both modes at the largest whole GiB the start accepts
    step e2e_fit 220 . ${E2E/--e2e-kv-memory 60/--e2e-kv-memory $FIT} --e2e-systems oscar-int2 oscar-bf16 \
      --e2e-time-limit 90 --out "$R/e2e_fit.json"
  fi
  step tests_memory 110 . $P -m gpu tests/runtime/worker/test_memory_profile.py
  step tests_graphs 100 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  step kernel 150 . python3 -m oscar_compile.bench.prefill_paged --sweep --contexts 32768 131072 --reps 5 --out "$R/prefill_paged.json"
  step tests_kernel 150 . $P -n 4 --instafail -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py ;;
20) # part 17 cut to the session's last device minutes: batch 32 at the 8192-token budget, both
    # modes, then the memory plan's GPU test
  step e2e_b32 190 . ${E2E/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 --out "$R/e2e_b32.json"
  step tests_memory 110 . $P -m gpu tests/runtime/worker/test_memory_profile.py ;;
18) # after part 17: the kernel rows with the history tiles swept at 32k (32-token tiles added), and TTFT
    # of one 32k and one 128k prompt, INT2 default beside the BF16 mode
  step kernel 200 . python3 -m oscar_compile.bench.prefill_paged --sweep --contexts 32768 8192 131072 --reps 5 \
    --out "$R/prefill_paged.json"
  step ttft 250 . $TTFT --ttft-contexts 32768 131072 --ttft-engines consistent+cache --out "$R/ttft.json"
  step tests_deterministic 150 . $P -m gpu tests/runtime/test_deterministic_gpu.py ;;
19) # bench.load, the 32-client workload at equal KV memory (50 GiB), INT2 then the BF16 mode
  step load32 560 . python3 -m oscar_compile.bench.load --launch random:8b --modes int2 bf16 --concurrency 32 \
    --duration 120 --prompt-len 1024:8192 --output-len 64:512 --stream-share 1 --disconnect-share 0 \
    --server-args "--kv-memory 50" --out "$R/load32.json" ;;
21) # part 19 in a short call (.whl now brings fastapi, starlette, uvicorn and opentelemetry-api, which the
    # server needs and the device lacks): 90 s per mode
  step load32 470 . python3 -m oscar_compile.bench.load --launch random:8b --modes int2 bf16 --concurrency 32 \
    --duration 90 --prompt-len 1024:8192 --output-len 64:512 --stream-share 1 --disconnect-share 0 \
    --server-args "--kv-memory 50" --out "$R/load32.json" ;;
22) # after call 21: the memory plan's GPU test with prompt scoring in blocks and the drawing rows' logits
    # copied (call 20: the step peaked 9.5 / 11.3 GiB over the plan's share on an H200), the CUDA-graph
    # tests with the collector paused during captures (call 17: a BF16 engine's capture invalidated), the
    # kernel at 128k with vs_ref of the partial path's plain decode (call 17: 8.5 % from the reference), and
    # TTFT of one 32k and one 128k prompt, INT2 default beside the BF16 mode
  step tests_memory 200 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -m gpu tests/runtime/worker/test_memory_profile.py
  step tests_graphs 100 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  step kernel 90 . python3 -m oscar_compile.bench.prefill_paged --contexts 131072 --reps 3 --out "$R/prefill_paged.json"
  step ttft 250 . $TTFT --ttft-contexts 32768 131072 --ttft-engines consistent+cache --out "$R/ttft.json" ;;
23) # the long-context load, one mode per call (each takes ~400 s): 64 clients, prompts 16k-32k,
    # outputs 512-1024, 300 s at 50 GiB; MODE=int2 or bf16, both on the same warm machine
  step load64 560 . python3 -m oscar_compile.bench.load --launch random:8b --modes ${MODE:-int2} --concurrency 64 \
    --duration 300 --prompt-len 16384:32768 --output-len 512:1024 --stream-share 1 --disconnect-share 0 \
    --server-args "--kv-memory 50" --out "$R/load64_${MODE:-int2}.json" ;;
24) # the paged kernel's tiles swept where the mixed step's chunk is the whole context (the sweep so far: at
    # 32k); the steps profile it was planned beside is part 27
  step kernel8k 150 . python3 -m oscar_compile.bench.prefill_paged --sweep --contexts 8192 --reps 5 --out "$R/prefill_paged_8k.json" ;;
26) # after call 25: the memory plan's GPU test, whose message now says live tensors or the allocator's
    # cache (call 25: 4.9 / 6.6 GiB over the share), the new 128k GPU test of the promoted history sums,
    # the CUDA-graph tests with the collector paused during captures (call 17: a BF16 capture invalidated)
  step tests_memory 200 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -m gpu tests/runtime/worker/test_memory_profile.py
  # the same test of one semantics with expandable segments (no fixed-size segments to fragment): if
  # this passes where the first fails, the excess is the cache across steps of many shapes
  step tests_memory_expandable 110 . env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m pytest -v -rs \
    --tb=short -p no:cacheprovider -m gpu tests/runtime/worker/test_memory_profile.py -k decode-consistent
  step tests_128k 90 . $P -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py -k 128k
  step tests_graphs 100 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  step ttft 180 . $TTFT --ttft-contexts 32768 131072 --ttft-engines consistent+cache --out "$R/ttft.json" ;;
29) # part 28 in a short call: the memory test, the 8k steps profile, the 128k test
  step tests_memory 190 . python3 -m pytest -v -s -rs --tb=short -p no:cacheprovider -m gpu tests/runtime/worker/test_memory_profile.py
  step steps 170 . python3 -m oscar_compile.bench.serve --shapes 8b --parts steps --max-num-batched-tokens 8192 \
    --step-contexts 8192 --step-decodes 31 --reps 3 --out "$R/steps.json"
  step tests_128k 60 . $P -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py -k 128k ;;
28) # one call when machines are scarce: the memory test with the allocator limited at the share (live
    # tensors and the reserve), the 8k steps profile that bounds batch 32, the CUDA-graph tests (captures
    # under the limit), the 128k test
  step tests_memory 190 . python3 -m pytest -v -s -rs --tb=short -p no:cacheprovider -m gpu tests/runtime/worker/test_memory_profile.py
  step steps 200 . python3 -m oscar_compile.bench.serve --shapes 8b --parts steps --max-num-batched-tokens 8192 \
    --step-contexts 8192 --step-decodes 31 --reps 5 --out "$R/steps.json"
  step tests_graphs 100 . python3 -m pytest -v -rs --tb=short -p no:cacheprovider -n 2 -m gpu tests/runtime/worker/test_cuda_graphs.py
  step tests_128k 70 . $P -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py -k 128k ;;
27) # where INT2's 8192-token steps lose their 8 % (call 17: 276 against 257 ms, batch 32 at 1.085x): the
    # prefill and the mixed step (31 decode rows) at 8k and 32k, both modes, each step's largest kernels;
    # then the end-to-end command on this tree (the promoted history sums: +1 % kernel time)
  step steps 330 . python3 -m oscar_compile.bench.serve --shapes 8b --parts steps --max-num-batched-tokens 8192 \
    --step-contexts 8192 32768 --step-decodes 31 --reps 5 --out "$R/steps.json"
  step e2e_b32 240 . ${E2E/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 --out "$R/e2e_b32.json" ;;
4)  # bundled model carried, no .carry-base: TTFT of both modes, the INT2 variants, the whole GPU suite
  step ttft_new 170 . $TTFT --ttft-contexts 32768 131072 --out "$R/ttft_new.json"
  step e2e_variants 150 . $E2E --e2e-systems oscar-int2-no-prefix-caching oscar-int2-prompt-exact --e2e-time-limit 70 --out "$R/e2e_variants.json"
  step tests_all 200 . $P -n 8 -m gpu tests ;;
0)  # the session's last device time: the tests of the changed path, then the end-to-end rows
  step tests_gpu 100 . $P -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py tests/cache \
    tests/runtime/worker/test_cuda_graphs.py tests/runtime/test_deterministic_gpu.py
  step e2e_new 170 . $E2E --e2e-systems oscar-int2 oscar-bf16 --e2e-time-limit 100 --out "$R/e2e_new.json"
  step kernel 40 . python3 -m oscar_compile.bench.prefill_paged --contexts 8192 32768 131072 --reps 5 --out "$R/prefill_paged.json"
  step ttft_new 130 . $TTFT --ttft-contexts 32768 --out "$R/ttft_new.json" ;;
8)  # the shortest call: the runtime's GPU tests of the chunk path, then the kernel's as far as they get
  step tests_runtime 70 . $P -m gpu tests/runtime/worker/test_cuda_graphs.py tests/cache
  step tests_kernel 60 . $P -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py ;;
9)  # a last call of a few minutes: the kernel's GPU tests, then batch 32 of both modes
  step tests_gpu 80 . $P -x -m gpu tests/kernels/attention/prefill/test_prefill_decode_consistent_paged.py tests/cache
  step e2e_new 170 . ${E2E/--e2e-batches 1 32/--e2e-batches 32} --e2e-systems oscar-int2 oscar-bf16 --out "$R/e2e_new.json" ;;
1)  # the first call: whatever comes after it may not get a machine
  step tests_gpu 140 . $P -m gpu tests/kernels/attention/prefill tests/cache tests/runtime/worker tests/runtime/test_deterministic_gpu.py
  step e2e_new 170 . $E2E --e2e-systems oscar-int2 oscar-bf16 --e2e-time-limit 100 --out "$R/e2e_new.json"
  step kernel 50 . python3 -m oscar_compile.bench.prefill_paged --contexts 8192 32768 131072 --reps 5 --out "$R/prefill_paged.json"
  step ttft_new 130 . $TTFT --ttft-contexts 32768 --out "$R/ttft_new.json"
  step e2e_base 150 .carry-base $E2E --e2e-systems oscar-int2 --e2e-time-limit 100 --out "$R/e2e_base.json" ;;
2)
  step ttft_new 200 . $TTFT --ttft-contexts 32768 131072 --out "$R/ttft_new.json"
  step ttft_base 150 .carry-base $TTFT --ttft-contexts 32768 131072 --out "$R/ttft_base.json"
  step e2e_variants 150 . $E2E --e2e-systems oscar-int2-no-prefix-caching oscar-int2-prompt-exact --e2e-time-limit 70 --out "$R/e2e_variants.json"
  step sweep 90 . python3 -m oscar_compile.bench.prefill_paged --sweep --contexts 32768 --reps 5 --out "$R/sweep.json" ;;
esac
cd "$OUT" && tar -czf results$PART.tgz r$PART && rm -rf r$PART; tar -xzOf results$PART.tgz r$PART/steps.txt
