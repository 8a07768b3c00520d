# Sourced by the results folders' run.sh: the device line, and `step`, which runs one command under a
# time limit that never passes the call's budget and tars $R after each (a call that runs over still
# brings back what finished). Needs R, PART and BUDGET_S; installs the carried .whl wheels first.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p "$R"
{ echo "tree: ${TREE:-?}"; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv;
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"; } > "$R/device.txt" 2>&1
T_END=$(( $(date +%s) + ${BUDGET_S:-420} ))
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s); local left=$(( T_END - t0 - 10 ))
  if [ "$left" -lt 20 ]; then echo "$name skipped: out of time" >> "$R/steps.txt"; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "\$ $*" > "$R/$name.log"
  (PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD timeout "$limit" "$@") >> "$R/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc ${limit}s-limit took=$(( $(date +%s) - t0 ))s" >> "$R/steps.txt"
  (cd "$OUT" && tar -czf "results$PART.tgz" "$(basename "$R")")
}
P="python3 -m pytest -q -rs --tb=short -p no:cacheprovider"
