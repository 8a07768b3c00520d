"""Deterministic mode's Triton matmul against cuBLAS (F.linear) on the 8B shapes, bfloat16: the
one-tile kernel of call 2 (64 x 64 x 128, 4 warps, for every M) against the row-dependent tiles
(matmul_triton.TILES) and two other decode tiles, with each variant's rows checked bitwise against
the product tiles. Prototype: run from the repository root,
`python3 bench/results/2026-12-03-h200-session4-kernels-serve/matmul_tiles.py OUT.json`."""
import json
import sys

import torch
import triton

from oscar_compile.kernels import matmul_triton as mt

PRODUCT = mt.TILES
VARIANTS = {
    "one_tile": ((None, 64, 64, 128, 4, 3),),
    "product": PRODUCT,
    "decode_n16": ((64, 64, 16, 128, 4, 4), PRODUCT[-1]),
    "decode_n64": ((64, 64, 64, 128, 4, 4), PRODUCT[-1]),
}
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
rows = []
for M in (1, 32, 8192):
    for name, (N, K) in SHAPES.items():
        if M == 8192 and name == "lm_head":
            continue  # the runtime computes logits for sampled rows only
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64
        row = dict(M=M, layer=name, N=N, K=K, cublas_us=1e3 * triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w)))
        mt.TILES = PRODUCT
        want = mt.linear_triton(x[:1], w)
        for label, tiles in VARIANTS.items():
            mt.TILES = tiles
            row[f"{label}_us"] = 1e3 * triton.testing.do_bench(lambda: mt.linear_triton(x, w))
            row[f"{label}_row0_equal"] = bool(torch.equal(mt.linear_triton(x, w)[:1], want))
        row["weight_GBps_cublas"] = N * K * 2 / row["cublas_us"] / 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
mt.TILES = PRODUCT
json.dump(rows, open(sys.argv[1], "w"), indent=1)
