#!/bin/bash
# device call: $1 = run name; $2 = bench timeout (s); rest = bench.kernels arguments
set -o pipefail
name=$1; bt=$2; shift 2
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache OMP_NUM_THREADS=4
R=$OUT/$name; mkdir -p $R
test -f kernels/attention_gluon_int8.py || { echo "tree without the int8 kernel"; pwd; ls kernels | head; exit 3; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > $R/device.txt 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/device.txt
echo "== gpu tests $(date -u +%T)" | tee $R/gpu_tests.log
timeout 200 python3 -m pytest -q -m gpu tests/kernels/test_attention_gluon_int8.py "tests/kernels/test_attention_gluon.py::test_dispatch_runs_gluon_for_decode_and_extend_for_prefill" -x --durations=5 2>&1 | tail -40 | tee -a $R/gpu_tests.log
if [ "${ERRORS:-1}" = 1 ]; then
  echo "== errors $(date -u +%T)" | tee $R/errors.log
  timeout 90 python3 .proto/d2/errors.py 2>&1 | tail -20 | tee -a $R/errors.log
fi
echo "== bench $(date -u +%T): python -m oscar_compile.bench.kernels --out $R/kernels.json $*" | tee $R/kernels.log
timeout $bt python3 -m oscar_compile.bench.kernels --out $R/kernels.json "$@" 2>&1 | tee -a $R/kernels.log
echo "== end $(date -u +%T) rc $?" | tee -a $R/kernels.log
tar -C $OUT -czf $OUT/$name.tgz $name && rm -rf $R
