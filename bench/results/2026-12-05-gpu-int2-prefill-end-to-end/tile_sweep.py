"""Tiles of the paged prefill kernel at one context, beyond bench.prefill_paged's sweep: 256-row
blocks (64 tokens x 4 heads) halve the stored-history decode per FLOP. One JSON row per config.
Usage: python3 tile_sweep.py CONTEXT OUT.json"""

import json
import sys

import torch

from oscar_compile.bench.prefill_paged import _inputs, time_ms
from oscar_compile.kernels.attention.prefill.decode_consistent_paged_triton import (
    attention_decode_consistent_paged_triton as paged,
)

context, out = int(sys.argv[1]), sys.argv[2]
args = _inputs(context - 8192, 8192, torch.device("cuda"))
rows = []
for tiles in (dict(block_rows=128, block_n=32, num_warps=4), dict(block_rows=256, block_n=32, num_warps=8),
              dict(block_rows=256, block_n=64, num_warps=8), dict(block_rows=128, block_n=32, num_warps=8),
              dict(block_rows=128, block_n=16, num_warps=4), dict(block_rows=256, block_n=16, num_warps=8)):
    try:
        rows.append({"context": context, "tiles": tiles, "paged_ms": time_ms(lambda t=tiles: paged(**args, **t), 5)})
    except Exception as e:
        rows.append({"context": context, "tiles": tiles, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open(out, "w"), indent=1)
