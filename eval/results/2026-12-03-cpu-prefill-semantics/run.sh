#!/bin/sh
# The prompt-exact vs decode-consistent measurement on the bundled model (CPU, float32), in the
# order that gives the default rule its numbers first: perplexity at 4k, the needle, then 1k / 2k.
# Each semantics runs the same held-out windows and needle prompts (same data, same seed).
# Usage: [EVAL_ARGS="--device cuda --dtype float32"] [OUT=dir] sh run.sh [NEEDLE_PER_CELL]
# (5 depths each; the issue asks >= 150 prompts per length: 30, the default). The simulation runs
# on any device: on a GPU the whole measurement takes minutes (on the shared 2-core CPU, hours).
set -e
OUT=${OUT:-eval/results/2026-12-03-cpu-prefill-semantics}
PER_CELL=${1:-30}
COMMON="--specs oscar-int2 --rotations-dir oscar_compile/bundled/oscar-tiny-qwen3/rotations --quiet --batch-size 4 \
  ${EVAL_ARGS:-}"
for C in 4096; do
  for S in prompt-exact decode-consistent; do
    python3 -m oscar_compile.evaluation $COMMON --context $C --num-samples 64 --tasks perplexity \
      --prefill-semantics $S --out $OUT/ppl-$C-$S
  done
done
for S in prompt-exact decode-consistent; do
  python3 -m oscar_compile.evaluation $COMMON --context 1024 2048 4096 --tasks needle \
    --needle-per-cell $PER_CELL --prefill-semantics $S --out $OUT/needle-$S
done
for C in 1024 2048; do
  for S in prompt-exact decode-consistent; do
    python3 -m oscar_compile.evaluation $COMMON --context $C --num-samples 64 --tasks perplexity \
      --prefill-semantics $S --out $OUT/ppl-$C-$S
  done
done
