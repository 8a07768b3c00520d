#!/usr/bin/env bash
# Sourced by this folder's call scripts: the wheels, the device line, and step(): each step has
# its own limit, never runs past T_END (BUDGET_S from now), and the results are tarred after each.
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
