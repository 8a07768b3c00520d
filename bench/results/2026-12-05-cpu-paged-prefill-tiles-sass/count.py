"""Registers, stack and SASS counts of the paged decode-consistent prefill kernel per tile config,
compiled offline for sm_90 (Triton's bundled ptxas / cuobjdump / nvdisasm; no GPU).
Usage (repository root): OMP_NUM_THREADS=1 TRITON_DEFAULT_FP_FUSION=1 PYTHONPATH=$PWD python3 count.py"""

import os
import re
import subprocess
import tempfile

import triton

from oscar_compile.kernels.attention.prefill.decode_consistent_paged_triton import compile_offline

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CONFIGS = [(128, 32, 4), (128, 16, 4), (128, 64, 8), (256, 16, 8), (256, 32, 8), (256, 64, 8)]

print("| block_rows | block_n | warps | registers | stack B | SASS | HGMMA | LDL + STL | shared B |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for rows, keys, warps in CONFIGS:
    kernel = compile_offline(block_rows=rows, block_n=keys, num_warps=warps)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([f"{BIN}/nvdisasm", "-c", f.name], capture_output=True, text=True).stdout
    lines = [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
    count = lambda *ops: sum(any(op in line for op in ops) for line in lines)  # noqa: E731
    regs, stack = re.search(r"REG:(\d+)", res).group(1), re.search(r"STACK:(\d+)", res).group(1)
    print(f"| {rows} | {keys} | {warps} | {regs} | {stack} | {len(lines)} | {count('HGMMA')} | "
          f"{count('LDL', 'STL')} | {kernel.metadata.shared} |")
