#!/bin/bash
# PROTOTYPE device run (issue #32). Usage (from the repo root on the device):
#   bash .proto/int8_decode/run_device.sh TAG [bench args...]
set -o pipefail
TAG=${1:-run}; shift
cd "$(dirname "$0")"
export PYTHONPATH=/tmp/site:$PWD/snap:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/$TAG; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > $R/device.txt 2>&1
timeout ${BENCH_TIMEOUT:-420} python3 bench_v2.py --out $R "$@" 2>&1 | tee $R/log.txt
echo "bench rc $?" | tee -a $R/log.txt
if [ -n "$NCU" ]; then
  for K in $NCU; do
    timeout 70 ncu --clock-control none --kernel-name regex:"$K" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      --section ComputeWorkloadAnalysis --section InstructionStats \
      python3 bench_v2.py --profile 131072 32 $( [ "$K" = "_decode_v2_kernel" ] && echo v2 || echo today ) > $R/ncu_$K.txt 2>&1
    echo "ncu $K rc $?" | tee -a $R/log.txt
  done
fi
true
tar -C $OUT -cf $OUT/results_$TAG.tar $TAG && rm -rf $R
ls -la $OUT
