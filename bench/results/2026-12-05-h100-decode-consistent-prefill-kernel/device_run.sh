#!/bin/bash
# one device call: offline-free SASS count, the benchmark rows, the gpu tests of the new kernel
cd "$(dirname "$0")" && export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p $OUT/r
LOG=$OUT/r/log.txt
{
echo "== device"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== bench: python -m oscar_compile.bench.prefill_paged --sweep --out \$OUT/r/prefill_paged.json"
timeout ${BENCH_S:-240} python -m oscar_compile.bench.prefill_paged ${BENCH_ARGS:---sweep} --out $OUT/r/prefill_paged.json
echo "bench rc $?"
echo "== gpu tests: python -m pytest -q -m gpu tests/kernels/attention/test_prefill_decode_consistent_paged.py"
timeout ${TEST_S:-150} python -m pytest -q -m gpu tests/kernels/attention/test_prefill_decode_consistent_paged.py ${TEST_ARGS}
echo "tests rc $?"
} 2>&1 | tee $LOG
cd $OUT && tar czf prefill_results.tgz r && rm -rf r
