"""Extend benchmark (part ``extend`` of ``python -m oscar_compile.bench.kernels``): a chunked-prefill step.

B sequences each add ``chunk`` new tokens after ``cached`` ones (B * chunk tokens in the step:
the runtime's default budget is 2048, the e2e benchmark runs 8192), one Qwen3-8B layer
(bench.kernel_setup), µs per layer from CUDA-graph replays, for:
- ``paged_bf16_us``: the paged BF16 kernel over full-precision pages (the goal's baseline);
- ``int2_us``: the fused INT2 Triton kernel (attention_triton, its defaults: 64 query rows and
  4 warps per program, no register cap), which decodes the history in every query block;
- ``extend_us``: the extend path the dispatch now takes for such calls (attention_extend_triton:
  the history dequantized once into scratch pages, then the paged BF16 kernel), and
  ``dequant_us`` its dequantization alone;
with each INT2 path's relative error against attention_ref on the same inputs (first and last
sequence; ``check``). Earlier sweeps of the fused kernel's launch knobs (rows 32 / 128, 8 warps,
a 128-register cap) lost by 1.4-3x and are no longer run (bench/results/2026-11-30-h200-write-clip-rope-prefill).
"""
from __future__ import annotations

import torch

from oscar_compile.bench.kernel_setup import (
    BITS,
    GROUP,
    H_KV,
    H_Q,
    RECENT,
    SINK,
    D,
    attention_args,
    bf16_paged_layers,
    graph_time_us,
    quantized_layers,
    reference_errors,
)
from oscar_compile.kernels import ops

# (cached, batch): chunks 2 and 4 of an 8k prompt at batch 8, one deep into a 32k prompt
EXTEND_SHAPES = ((2048, 8), (6144, 8), (30720, 1))


def bench_extend(cached: int, B: int, chunk: int = 2048, check: bool = True, device: str = "cuda") -> dict:
    """One row: the three paths' µs per layer, tokens/s, ratios to paged BF16 and errors
    (``device`` other than CUDA: only for a smoke test of this code under the interpreter)."""
    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton
    from oscar_compile.kernels.attention.prefill.attention_extend_triton import (
        MAX_SCRATCH_BYTES,
        attention_extend_triton,
        scratch_bytes,
    )
    from oscar_compile.kernels.layout.cache_dequant_triton import dequantize_cache_triton

    dev = torch.device(device)
    scale = D ** -0.5
    N = B * chunk
    q = torch.randn(N, H_Q, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(N, H_KV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32) * chunk
    lens = torch.full((B,), cached, device=dev, dtype=torch.int32)
    row = {"cached": cached, "batch": B, "chunk": chunk}
    pages = bf16_paged_layers(B, cached, dev)
    row["paged_bf16_us"] = graph_time_us(
        [lambda kp=kp, vp=vp, pt=pt: ops.attention_bf16(q, k, v, cu, lens, pt, kp, vp, scale)
         for kp, vp, pt in pages], reps=10)
    del pages
    layers = quantized_layers(B, cached, torch.float16, dev)
    fns = {
        "int2": lambda p, tb: attention_triton(**attention_args(q, k, v, cu, lens, tb, p, scale)),
        "extend": lambda p, tb: attention_extend_triton(**attention_args(q, k, v, cu, lens, tb, p, scale)),
        "dequant": lambda p, tb: dequantize_cache_triton(lens, *tb, *p, SINK, RECENT, BITS, GROUP),
    }
    for name, fn in fns.items():
        try:
            row[f"{name}_us"] = graph_time_us([lambda p=p, tb=tb, fn=fn: fn(p, tb) for p, tb in layers], reps=10)
        except Exception as e:  # keep the other paths' numbers
            row[f"{name}_us"] = None
            row[f"{name}_error"] = repr(e)[:300]
    pools, (wt, qt) = layers[0]
    row["extend_scratch_bytes"] = min(scratch_bytes(B, wt, qt, pools.k_win), MAX_SCRATCH_BYTES)  # allocated
    row["bf16_tokens_per_s"] = N / (row["paged_bf16_us"] * 1e-6)
    for name in ("int2", "extend"):
        if row[f"{name}_us"]:
            row[f"{name}_tokens_per_s"] = N / (row[f"{name}_us"] * 1e-6)
            row[f"{name}_vs_paged_bf16"] = row[f"{name}_us"] / row["paged_bf16_us"]
    if check:
        got = {name: fns[name](*layers[0]) for name in ("int2", "extend")}
        errs = reference_errors(got, q, k, v, cu, lens, layers[0], scale)
        row.update({f"{name}_rel_err": e for name, e in errs.items()})
    del layers
    torch.cuda.empty_cache()
    return row
