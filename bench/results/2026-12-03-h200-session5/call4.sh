#!/usr/bin/env bash
# Device call 4 of session 5: the structured-output row once more, for its batch-32 TTFT after
# the batched gather of cached positions (call 3: 4.59 s, prompt-exact 0.43 s in session 4).
#   BUDGET_S=150 bash bench/results/2026-12-03-h200-session5/call4.sh
set -u
source "$(dirname "$0")/common.sh"
step serve_structured 140 python3 -m oscar_compile.bench.serve --shapes 8b --parts structured --structured-batch 32 \
  --structured-prompt 512 --structured-output 128 --out "$R/serve_structured.json"
cd "$OUT" && tar -czf results.tgz r && rm -rf r; tar -xzOf results.tgz r/steps.txt
