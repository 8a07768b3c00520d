#!/bin/bash
# PROTOTYPE device run 3 (issue #32): the QLO+PLO kernel after the mask trims; launch-plan and register
# variants; the cp.async 3-stage variant in its own process; ncu stall profile.
set -o pipefail
cd "$(dirname "$0")"
export PYTHONPATH=/tmp/site:$PWD/snap:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
R=$OUT/run3; mkdir -p $R/cp
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > $R/device.txt 2>&1
timeout 255 python3 bench_v2.py --out $R --shapes 131072x32,32768x32,131072x1,8192x32,32768x1,8192x1 --parts check time --check v2_qp,v2_qp_rm --time v2_qp,v2_qp_rm --variants 2>&1 | tee $R/log.txt
echo "bench rc $?" | tee -a $R/log.txt
timeout 150 python3 bench_v2.py --out $R/cp --shapes 131072x32,32768x32,131072x1,8192x32,32768x1,8192x1 --parts check time --check v2_qp_cp3,v2_qp_rm_cp3 --time v2_qp_cp3,v2_qp_rm_cp3,v2_qp_r96 --no-baseline 2>&1 | tee $R/cp/log.txt
echo "bench cp rc $?" | tee -a $R/log.txt
V2_NAME=v2_qp_rm timeout 40 ncu --clock-control none --kernel-name regex:_decode_v2_kernel --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --print-details all \
  python3 bench_v2.py --profile 131072 32 v2 > $R/ncu_v2_128k_b32.txt 2>&1
echo "ncu 1 rc $?" | tee -a $R/log.txt
V2_NAME=v2_qp_rm timeout 40 ncu --clock-control none --kernel-name regex:_decode_v2_kernel --launch-skip 1 --launch-count 1 \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
  python3 bench_v2.py --profile 131072 32 v2 > $R/ncu_v2_128k_b32_stalls.txt 2>&1
echo "ncu 2 rc $?" | tee -a $R/log.txt
tar -C $OUT -cf $OUT/results_run3.tar run3 && rm -rf $R
ls -la $OUT
