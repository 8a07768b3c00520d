"""What the kernel benchmarks share (bench.kernels, bench.extend, bench.decode_consistent,
bench.prefill_paged): the layer shape, CUDA-event and CUDA-graph timing, random caches.

One Qwen3-8B attention layer (32 query heads, 8 KV heads, head_dim 128), sink 64, recent 256,
page 16, INT2 with group 128, clip ratios 0.96 / 0.92. Graph timings replay a CUDA graph over
enough per-layer buffers that one replay's data is >= 3x the 60 MB L2 (no layer is served from L2).
"""
from __future__ import annotations

import math
import statistics

import torch

from oscar_compile.formats.op_args import AttentionArgs
from oscar_compile.kernels.pools import allocate_pools

HBM_BYTES_PER_S = 4.3e12
L2_BYTES = 60e6
H_Q, H_KV, D, LAYERS = 32, 8, 128, 36
SINK, RECENT, P, BITS, GROUP = 64, 256, 16, 2, 128
CLIPS = dict(clip_k=0.96, clip_v=0.92)  # the layer's cache-write (and decode-consistent) clip ratios


def time_ms(fn, reps: int) -> float:
    """Median of ``reps`` calls of ``fn`` on the current CUDA stream, CUDA events, in ms (after one
    warm-up call: compilation is not timed)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_time_us(calls, reps: int = 15) -> float:
    """Median time of one call, from CUDA-graph replays of all ``calls`` (one per layer buffer)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:  # compile / autotune outside the graph
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    torch.cuda.synchronize()
    ms = time_ms(graph.replay, reps)
    del graph
    return ms * 1e3 / len(calls)


def num_buffers(layer_bytes: float) -> int:
    return max(1, min(LAYERS, math.ceil(3 * L2_BYTES / layer_bytes)))


def make_tables(B: int, pages_per_seq: int, device) -> torch.Tensor:
    """[B, pages_per_seq] int32: a random permutation of the pages (no contiguity to exploit)."""
    n = max(B * pages_per_seq, 1)
    return torch.randperm(n, device=device).to(torch.int32).view(B, pages_per_seq)


def attention_args(q, k, v, cu_seqlens, cache_lens, tables, pools, scale: float, bits: int = BITS) -> dict:
    """One INT-b layer's attention arguments by name (``tables`` = (window, quant), ``pools`` a
    ``CachePools``), for a kernel wrapper or the reference as ``fn(**attention_args(...))``."""
    window_table, quant_table = tables
    return AttentionArgs(q=q, k=k, v=v, cu_seqlens=cu_seqlens, cache_lens=cache_lens, window_table=window_table,
                         quant_table=quant_table, **pools._asdict(), scale=scale, sink=SINK, recent=RECENT, bits=bits,
                         group_size=GROUP)._asdict()


def quantized_layer(B: int, ctx: int, sdt: torch.dtype, device, bits: int = BITS):
    """Random INT-b pools (codes, scales, zeros, windows) for B sequences holding ctx tokens."""
    hist = max(0, ctx - SINK - RECENT)
    qpages, wpages = -(-hist // P), (SINK + RECENT) // P
    pools = allocate_pools(B * qpages, B * wpages, H_KV, P, D, bits, GROUP, sdt, torch.bfloat16, device)
    for c in (pools.k_codes, pools.v_codes):
        c.copy_(torch.randint(0, 256, c.shape, dtype=torch.uint8, device=device))
    for s in (pools.k_scale, pools.v_scale):
        s.copy_(torch.rand(s.shape, device=device) * 0.08 + 0.02)
    for z in (pools.k_zero, pools.v_zero):
        z.copy_(torch.rand(z.shape, device=device) * 3)
    for w in (pools.k_win, pools.v_win):
        w.copy_(torch.randn(w.shape, device=device))
    tables = (make_tables(B, wpages, device), make_tables(B, qpages, device))
    return pools, tables


def chunk_args(cached: int, chunk: int, device) -> dict:
    """One sequence's prefill chunk: ``chunk`` new tokens (random BF16 q [chunk, H_q, D], k, v
    [chunk, H_kv, D], seed 0) after ``cached`` ones in random INT2 pools (fp16 scale / zero, at least
    one history page; only the first ``cached`` positions are read), the attention arguments by name."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(chunk, h, D, device=device, generator=gen, dtype=torch.bfloat16) for h in (H_Q, H_KV, H_KV))
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    lens = torch.tensor([cached], dtype=torch.int32, device=device)
    pools, tables = quantized_layer(1, max(cached, SINK + RECENT + 16), torch.float16, device)
    return attention_args(q, k, v, cu, lens, tables, pools, D**-0.5)


def quantized_layers(B: int, ctx: int, sdt: torch.dtype, device, bits: int = BITS) -> list[tuple]:
    """Enough ``quantized_layer``s (pools, tables) to rotate through that L2 holds none of them."""
    return [quantized_layer(B, ctx, sdt, device, bits) for _ in range(num_buffers(quantized_bytes(B, ctx, sdt, bits)))]


def bf16_paged_layers(B: int, ctx: int, device) -> list[tuple]:
    """Enough full-precision paged layers for B sequences of ``ctx`` cached tokens that L2 holds
    none of them: (k pages, v pages [B * ceil(ctx / P), H_kv, P, D] random bf16, tables
    [B, ceil(ctx / P)]), for the paged BF16 kernel."""
    npages = -(-ctx // P)
    return [(torch.randn(B * npages, H_KV, P, D, device=device, dtype=torch.bfloat16),
             torch.randn(B * npages, H_KV, P, D, device=device, dtype=torch.bfloat16),
             make_tables(B, npages, device)) for _ in range(num_buffers(B * H_KV * ctx * 2 * D * 2))]


def reference_errors(outputs: dict, q, k, v, cu, lens, layer, scale: float, bits: int = BITS) -> dict[str, float]:
    """The relative error of each output ([N, H_q, D], one per path, all on the same inputs and
    ``layer`` = (pools, tables)) against attention_ref, the largest over the first and the last
    sequence (the reference, one sequence at a time, is too slow for every one of them)."""
    from oscar_compile.kernels.attention.decode.attention_ref import attention_ref

    pools, (wt, qt) = layer
    errs: dict[str, list[float]] = {name: [] for name in outputs}
    for i in sorted({0, len(lens) - 1}):
        a, b = int(cu[i]), int(cu[i + 1])
        one = torch.tensor([0, b - a], dtype=torch.int32, device=cu.device)
        want = attention_ref(**attention_args(q[a:b], k[a:b], v[a:b], one, lens[i:i + 1], (wt[i:i + 1], qt[i:i + 1]),
                                              pools, scale, bits))
        for name, got in outputs.items():
            errs[name].append(rel_err(got[a:b], want))
        del want
    return {name: max(e) for name, e in errs.items()}


def quantized_bytes(B: int, ctx: int, sdt: torch.dtype, bits: int = BITS) -> float:
    hist = max(0, ctx - SINK - RECENT)
    per_tok = 2 * (D * bits // 8 + 2 * (D // GROUP) * torch.finfo(sdt).bits // 8)
    return B * H_KV * (hist * per_tok + (ctx - hist) * 2 * D * 2)


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
