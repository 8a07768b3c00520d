"""Deterministic mode's Triton matmul against cuBLAS (F.linear) on the 8B shapes, bfloat16, with
split-K off (SPLIT_TARGET 1) and at targets 128 / 256 (matmul_triton.split_k). Prototype: run from
the repository root, `python3 bench/results/2026-12-03-h200-session4-kernels-serve/matmul_split.py OUT.json`."""
import json
import sys

import torch
import triton

from oscar_compile.kernels import matmul_triton as mt

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
        for target in (1, 128, 256):
            mt.SPLIT_TARGET = target
            row[f"splits_{target}"] = mt.split_k(N, K)
            row[f"triton_{target}_us"] = 1e3 * triton.testing.do_bench(lambda: mt.linear_triton(x, w))
        row["weight_GBps_cublas"] = N * K * 2 / row["cublas_us"] / 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
mt.SPLIT_TARGET = 128
json.dump(rows, open(sys.argv[1], "w"), indent=1)
