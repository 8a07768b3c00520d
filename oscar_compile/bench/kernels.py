"""Kernel benchmark (docs/design.md §8.1-8.2): paged INT2 decode attention and the cache write, on GPU.

    python -m oscar_compile.bench.kernels [--out bench.json] [--quick] [--parts ...]

One Qwen3-8B attention layer (32 query heads, 8 KV heads, head_dim 128), sink 64, recent 256,
page 16. Decode attention at context 8k / 32k / 128k and batch 1 / 8 / 32 (batch * context <= 4M)
for: torch SDPA on a contiguous BF16 cache (fastest of cuDNN / flash / efficient, GQA), the paged
BF16 Triton kernel, the paged INT2 Triton kernel and (on sm_90) the Gluon Hopper kernel, each with
fp16 and fp32 scale/zero. Each variant
is captured in a CUDA graph over enough per-layer buffers (up to 36) that the data of one replay
is >= 3x the 60 MB L2, so no layer is served from L2; time = replay time / layers (median).
Then the cache write: microseconds per layer per decode step against batch, prefill tokens/s, and
correctness of every kernel against its reference at the benchmark shapes (same command).
Part ``extend`` (module bench.extend) times a chunked-prefill step (2048 new tokens per sequence
after a cached prefix) for the paged BF16 kernel, the fused INT2 kernel and the extend path (the
history dequantized once, then the paged BF16 kernel), with the INT2 paths' errors. Parts
``variants`` and ``write-variants`` sweep the launch knobs (history splits, window programs,
window block, merge; rows per program, warps) that the kernels' defaults come from;
``gluon-variants`` the Gluon kernel's history splits and window programs; ``int8-variants`` those of
the 8-bit integer kernel (bench/kernels_int8.py: splits, window programs, the deterministic mode,
the merge alone). On sm_90 the attention table has a row for each Gluon kernel, the 8-bit integer
one (``gluon_int8_fp16``) included.
Prints a table; writes everything to JSON.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings

import torch

from oscar_compile.bench.extend import EXTEND_SHAPES, bench_extend
from oscar_compile.bench.kernel_setup import (
    BITS,
    CLIPS,
    GROUP,
    H_KV,
    H_Q,
    HBM_BYTES_PER_S,
    LAYERS,
    RECENT,
    SINK,
    D,
    P,
    attention_args,
    bf16_paged_layers,
    graph_time_us,
    num_buffers,
    quantized_bytes,
    quantized_layer,
    quantized_layers,
    reference_errors,
    rel_err,
)
from oscar_compile.evaluation.result_file import save_json
from oscar_compile.formats.op_args import POOLS, CacheWriteArgs
from oscar_compile.kernels import ops
from oscar_compile.kernels.cache_write.cache_write_triton import cache_write_triton


def bench_attention(ctx: int, B: int, check: bool) -> dict:
    dev = torch.device("cuda")
    scale = D ** -0.5
    row = {"context": ctx, "batch": B}
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    vn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    bf16_bytes = B * H_KV * ctx * 2 * D * 2
    row["bf16_bytes"] = bf16_bytes
    nb = num_buffers(bf16_bytes)
    # torch SDPA, contiguous BF16 cache: the fastest backend that runs
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kv = [(torch.randn(B, H_KV, ctx, D, device=dev, dtype=torch.bfloat16),
           torch.randn(B, H_KV, ctx, D, device=dev, dtype=torch.bfloat16)) for _ in range(nb)]
    q4 = q.unsqueeze(2)
    sdpa = {}
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            def sdpa_call(k=None, v=None, be=be):
                with sdpa_kernel([be]):
                    return torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            sdpa[name] = graph_time_us([lambda k=k, v=v: sdpa_call(k, v) for k, v in kv])
        except Exception as e:  # a backend that refuses the shape is skipped, and said so
            sdpa[name] = f"unavailable: {type(e).__name__}"
    del kv
    times = [t for t in sdpa.values() if isinstance(t, float)]
    row["sdpa_us"] = min(times)
    row["sdpa_backends"] = sdpa
    # paged BF16 (Triton)
    pages = bf16_paged_layers(B, ctx, dev)
    row["paged_bf16_us"] = graph_time_us(
        [lambda kp=kp, vp=vp, pt=pt: ops.attention_bf16(q, kn, vn, cu, lens, pt, kp, vp, scale)
         for kp, vp, pt in pages])
    if check:
        from oscar_compile.kernels.attention.attention_bf16_ref import attention_bf16_ref

        kp, vp, pt = pages[0]
        got = ops.attention_bf16(q, kn, vn, cu, lens, pt, kp, vp, scale)[:1]
        want = attention_bf16_ref(q[:1], kn[:1], vn[:1], cu[:2], lens[:1], pt[:1], kp, vp, scale)
        row["paged_bf16_rel_err"] = rel_err(got, want)
    del pages
    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton

    kernels = [(attention_triton, torch.float16, "int2_fp16", 2), (attention_triton, torch.float16, "int4_fp16", 4)]
    if gluon_runs():
        from oscar_compile.kernels.attention.decode.attention_gluon import attention_gluon
        from oscar_compile.kernels.attention.decode.attention_gluon_int8 import attention_gluon_int8

        # (INT2 at head_dim 128 is masked since cache format version 2: the fp16-operand Gluon kernel
        # reads INT4 only here; its last INT2 rows are in bench/results/2026-12-03-h200-int2-decode-int8-product)
        kernels += [(attention_gluon, torch.float16, "gluon_int4_fp16", 4),
                    (attention_gluon_int8, torch.float16, "gluon_int8_fp16", 2)]
    for kernel, sdt, tag, bits in kernels:
        nbytes = quantized_bytes(B, ctx, sdt, bits)
        layers = quantized_layers(B, ctx, sdt, dev, bits)

        def call(pools, tables, kernel=kernel, bits=bits):
            return kernel(**attention_args(q, kn, vn, cu, lens, tables, pools, scale, bits))

        t = graph_time_us([lambda p=p, tb=tb: call(p, tb) for p, tb in layers])
        row[f"{tag}_us"] = t
        row[f"{tag}_bytes"] = nbytes
        row[f"{tag}_gbps"] = nbytes / t * 1e-3
        row[f"{tag}_pct_hbm"] = 100 * nbytes / (t * 1e-6) / HBM_BYTES_PER_S
        row[f"{tag}_kv_elems_per_s"] = B * ctx * H_KV * D * 2 / (t * 1e-6)
        row[f"{tag}_speedup_vs_sdpa"] = row["sdpa_us"] / t
        row[f"{tag}_speedup_vs_paged_bf16"] = row["paged_bf16_us"] / t
        if check:
            got = {tag: call(*layers[0])}
            row[f"{tag}_rel_err"] = reference_errors(got, q, kn, vn, cu, lens, layers[0], scale, bits)[tag]
        del layers
    row["paged_bf16_gbps"] = bf16_bytes / row["paged_bf16_us"] * 1e-3
    row["sdpa_gbps"] = bf16_bytes / row["sdpa_us"] * 1e-3
    row["sdpa_pct_hbm"] = 100 * bf16_bytes / (row["sdpa_us"] * 1e-6) / HBM_BYTES_PER_S
    torch.cuda.empty_cache()
    return row


def gluon_runs() -> bool:
    """The Gluon Hopper kernel can run here (sm_90 and a Triton with Gluon)."""
    from oscar_compile.kernels.attention.attention_dispatch import gluon_device_problem

    return gluon_device_problem(torch.cuda.current_device()) is None


def _decode_case(ctx: int, B: int):
    """One decode step's inputs at (context, batch): q [B, H_q, D] and new k = v [B, H_kv, D] in
    bf16, cu_seqlens, cache_lens, the bytes one call reads, enough INT2 layers (tables, pools) to
    rotate through so that L2 holds none of them, and the longest history."""
    dev = torch.device("cuda")
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    nbytes = quantized_bytes(B, ctx, torch.float16)
    layers = quantized_layers(B, ctx, torch.float16, dev)
    max_hist = layers[0][1][1].shape[1] * P
    return dev, q, kn, cu, lens, nbytes, layers, max_hist


def bench_gluon_variants(ctx: int, B: int) -> list[dict]:
    """The Gluon kernel at one shape against its number of history splits and window programs
    (``planned`` marks the default plan)."""
    from oscar_compile.kernels.attention.decode.attention_gluon import MAXNREG, attention_gluon, plan_gluon_launch

    dev, q, kn, cu, lens, nbytes, layers, max_hist = _decode_case(ctx, B)
    out = []
    sweep = []
    for cap in (96, 104, 128):  # each with its own plan (the occupancy it buys)
        plan = plan_gluon_launch(B, B, H_KV, H_Q // H_KV, max_hist, SINK, RECENT, dev, cap, D)
        sweep += [dict(maxnreg=cap, nsplit=plan[0], win_splits=plan[1])]
    plan = plan_gluon_launch(B, B, H_KV, H_Q // H_KV, max_hist, SINK, RECENT, dev)
    sweep += [dict(nsplit=n, win_splits=plan[1]) for n in sorted({max(1, plan[0] // 2), 2 * plan[0]})]
    sweep += [dict(stages=2), dict(stages=4), dict(win_splits=2)]
    planned = plan
    for kw in sweep:
        try:
            t = graph_time_us([lambda p=p, tb=tb, kw=kw: attention_gluon(
                **attention_args(q, kn, kn, cu, lens, tb, p, D ** -0.5), **kw)
                for p, tb in layers])
            out.append({"context": ctx, "batch": B, **kw, "planned": kw == {"maxnreg": MAXNREG, "nsplit": planned[0],
                                                                            "win_splits": planned[1]},
                        "us": t, "pct_hbm": 100 * nbytes / (t * 1e-6) / HBM_BYTES_PER_S})
        except Exception as e:
            out.append({"context": ctx, "batch": B, **kw, "error": repr(e)[:300]})
        print(json.dumps(out[-1]), flush=True)
    del layers
    torch.cuda.empty_cache()
    return out


def bench_variants(ctx: int, B: int) -> list[dict]:
    """INT2 decode at one shape against the number of history splits, window programs and the
    window block; then the merge kernel alone at the planned split.

    Small batches are latency-bound: a split is a chain of dependent block iterations, so more,
    shorter splits shorten the chain at the cost of a larger merge; the windows (sink + recent
    slots, ``block_w`` keys at a time) are another chain, which ``win_splits`` programs share.
    ``planned`` marks the default plan. (bench/results/kernels_h200.json swept the history block,
    num_warps, pipelining depth and the bit-trick decode: 128, 4 warps, 2 stages and the bit trick
    won.)"""
    from oscar_compile.kernels.attention.attention_blocks_triton import merge_partials
    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton, plan_launch, window_programs

    dev, q, kn, cu, lens, nbytes, layers, max_hist = _decode_case(ctx, B)
    out = []
    block_n = 128
    planned = plan_launch(B, B, H_KV, H_Q // H_KV, max_hist, dev, block_n, min_split_blocks=2)[2]
    planned_win = window_programs(SINK + RECENT, 32, max_hist, block_n, planned) if planned else 1
    for block_w in (16, 32):
        for nsplit in sorted({planned, 32, 64}):
            if nsplit * block_n > max(max_hist, block_n) * 2:
                continue  # splits that would all be empty
            for win_splits in (1, 2, 3, 5):
                kw = dict(block_n=block_n, block_w=block_w, nsplit=nsplit, win_splits=win_splits)
                is_plan = nsplit == planned and win_splits == planned_win and block_w == 32
                try:
                    t = graph_time_us([lambda p=p, tb=tb, kw=kw: attention_triton(
                        **attention_args(q, kn, kn, cu, lens, tb, p, D ** -0.5), **kw)
                        for p, tb in layers])
                    out.append({"context": ctx, "batch": B, **kw, "planned": is_plan, "us": t,
                                "kv_elems_per_s": B * ctx * H_KV * D * 2 / (t * 1e-6)})
                except Exception as e:
                    out.append({"context": ctx, "batch": B, **kw, "error": repr(e)[:300]})
    ns = planned + planned_win
    po = [torch.randn(B * H_Q * ns, D, device=dev) for _ in layers]
    pl = [torch.randn(B * H_Q * ns, device=dev) for _ in layers]
    res = torch.empty(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    for block_d in (D, 32):
        t = graph_time_us([lambda a=a, b=b, block_d=block_d: merge_partials(a, b, res, ns, block_d=block_d)
                           for a, b in zip(po, pl, strict=True)])
        out.append({"context": ctx, "batch": B, "merge_only": True, "partials": ns,
                    "block_d": block_d, "us": t})
    del layers
    torch.cuda.empty_cache()
    return out


def write_args(k, v, cu, lens, tables, pools) -> CacheWriteArgs:
    """The ``oscar::cache_write`` arguments of the benchmark layer (clip ratios 0.96 / 0.92)."""
    wt, qt = tables
    return CacheWriteArgs(k=k, v=v, cu_seqlens=cu, cache_lens=lens, window_table=wt, quant_table=qt,
                          **dict(zip(POOLS, pools, strict=True)), sink=SINK, recent=RECENT, bits=BITS, group_size=GROUP,
                          **CLIPS)


def pools_of(a: CacheWriteArgs) -> tuple:
    """The eight pools of a write, in ``POOLS`` order."""
    return tuple(getattr(a, name) for name in POOLS)


def on_cpu(a: CacheWriteArgs) -> CacheWriteArgs:
    """The same write with every tensor on the CPU (the reference's oracle run)."""
    return a._replace(**{name: x.cpu() for name, x in a._asdict().items() if isinstance(x, torch.Tensor)})


def reference_write(a: CacheWriteArgs) -> None:
    """``cache_write_ref`` of a write without a key rotation (the reference takes no rot_k / mean_k)."""
    from oscar_compile.kernels.cache_write.cache_write_ref import cache_write_ref

    fields = a._asdict()
    del fields["rot_k"], fields["mean_k"]
    cache_write_ref(**fields)


def decode_write_inputs(B: int, dev, ctx: int = 4096) -> CacheWriteArgs:
    """The cache write of a decode step for B sequences of ctx tokens: the ring is full, so every
    step also demotes (quantizes) one token per sequence."""
    pools, tables = quantized_layer(B, ctx + 1, torch.float16, dev)
    k = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    return write_args(k, v, cu, lens, tables, pools)


def bench_write_variants() -> list[dict]:
    """Decode-step cache write against rows per program and warps."""
    dev = torch.device("cuda")
    out = []
    for B in (1, 8, 64):
        a = decode_write_inputs(B, dev)
        for block_t in (1, 4, 8):
            for num_warps in (1, 2, 4):
                kw = dict(block_t=block_t, num_warps=num_warps)
                try:
                    t = graph_time_us([lambda a=a, kw=kw: cache_write_triton(**a._asdict(), **kw)] * LAYERS)
                    out.append({"batch": B, **kw, "us_per_layer": t})
                except Exception as e:
                    out.append({"batch": B, **kw, "error": repr(e)[:300]})
    return out


def bench_write(check: bool) -> dict:
    """Cache write: µs per layer per decode step vs batch (plain, and with the key rotation the op
    does first when given one); prefill tokens/s."""
    dev = torch.device("cuda")
    res = {"decode": [], "prefill": []}
    rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=dev, dtype=torch.float64))[0].float()
    mean = torch.randn(H_KV, D, device=dev)
    for B in (1, 8, 32, 64):
        a = decode_write_inputs(B, dev)
        t = graph_time_us([lambda a=a: ops.cache_write(*a)] * LAYERS)
        tr = graph_time_us([lambda a=a: ops.cache_write(*a._replace(rot_k=rot, mean_k=mean))] * LAYERS)
        entry = {"batch": B, "us_per_layer": t, "us_per_layer_with_rotation": tr}
        if check:  # the oracle is the CPU reference (see tests/kernels/cache_write/test_cache_write_triton.py)
            ref = on_cpu(a)
            reference_write(ref)
            cache_write_triton(**a._asdict())
            entry["bitwise_equal"] = all(
                torch.equal(x.cpu(), y) for x, y in zip(pools_of(a), pools_of(ref), strict=True)
            )
        res["decode"].append(entry)
    for B, T in ((1, 32768), (8, 4096)):
        N = B * T
        pools, tables = quantized_layer(B, T, torch.float16, dev)
        k = torch.randn(N, H_KV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(B + 1, device=dev, dtype=torch.int32) * T
        lens = torch.zeros(B, device=dev, dtype=torch.int32)
        a = write_args(k, v, cu, lens, tables, pools)
        t = graph_time_us([lambda a=a: ops.cache_write(*a)], reps=10)
        entry = {"batch": B, "tokens": N, "us": t, "tokens_per_s": N / (t * 1e-6)}
        if check and N <= 32768:  # both from zeroed pools
            ref = on_cpu(a)._replace(
                **{name: torch.zeros_like(x, device="cpu") for name, x in zip(POOLS, pools, strict=True)}
            )
            got = a._replace(**{name: torch.zeros_like(x) for name, x in zip(POOLS, pools, strict=True)})
            reference_write(ref)
            cache_write_triton(**got._asdict())
            entry["bitwise_equal"] = all(
                torch.equal(x.cpu(), y) for x, y in zip(pools_of(got), pools_of(ref), strict=True)
            )
        res["prefill"].append(entry)
    return res


def profile_launches(ctx: int, B: int, kernel: str) -> None:
    """Plain launches of one decode kernel (for Nsight Compute: ``ncu --kernel-name regex:...``)."""
    from oscar_compile.kernels.attention.decode.attention_gluon import attention_gluon
    from oscar_compile.kernels.attention.decode.attention_gluon_int8 import attention_gluon_int8
    from oscar_compile.kernels.attention.decode.attention_triton import attention_triton

    fn = {"gluon": attention_gluon, "int8": attention_gluon_int8, "triton": attention_triton}[kernel]
    _, q, kn, cu, lens, _, layers, _ = _decode_case(ctx, B)
    pools, tables = layers[0]
    for _ in range(5):
        fn(**attention_args(q, kn, kn, cu, lens, tables, pools, D ** -0.5))
    torch.cuda.synchronize()


def device_line() -> str:
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        gpu = smi.stdout.strip()
    except Exception:
        gpu = torch.cuda.get_device_name()
    import triton

    return f"{gpu}; torch {torch.__version__}; triton {triton.__version__}"


def print_table(rows: list[dict], write: dict) -> None:
    if write.get("error"):
        print("write part failed:", write["error"])
    hdr = (f"{'ctx':>6} {'B':>3} {'sdpa_us':>8} {'bf16pg':>7} | {'triton':>7} {'%HBM':>5} {'x_sdpa':>6} "
           f"{'err':>7} | {'gluon':>7} {'%HBM':>5} {'x_sdpa':>6} {'err':>7} {'x_trit':>6} | "
           f"{'gl_fp32s':>8} {'x_sdpa':>6} | {'tri_int4':>8} {'x_sdpa':>6} {'gl_int4':>7} {'%HBM':>5} "
           f"{'x_sdpa':>6} {'err':>7} | {'gl_int8':>7} {'%HBM':>5} {'x_sdpa':>6} {'err':>7}")
    print(hdr)
    nan = float("nan")
    for r in rows:
        print(f"{r['context']:>6} {r['batch']:>3} {r['sdpa_us']:>8.1f} {r['paged_bf16_us']:>7.1f} | "
              f"{r['int2_fp16_us']:>7.1f} {r['int2_fp16_pct_hbm']:>5.1f} {r['int2_fp16_speedup_vs_sdpa']:>6.2f} "
              f"{r.get('int2_fp16_rel_err', nan):>7.1e} | {r.get('gluon_fp16_us', nan):>7.1f} "
              f"{r.get('gluon_fp16_pct_hbm', nan):>5.1f} {r.get('gluon_fp16_speedup_vs_sdpa', nan):>6.2f} "
              f"{r.get('gluon_fp16_rel_err', nan):>7.1e} "
              f"{r['int2_fp16_us'] / r.get('gluon_fp16_us', nan):>6.2f} | "
              f"{r.get('gluon_fp32_us', nan):>8.1f} {r.get('gluon_fp32_speedup_vs_sdpa', nan):>6.2f} | "
              f"{r['int4_fp16_us']:>8.1f} {r['int4_fp16_speedup_vs_sdpa']:>6.2f} "
              f"{r.get('gluon_int4_fp16_us', nan):>7.1f} "
              f"{r.get('gluon_int4_fp16_pct_hbm', nan):>5.1f} {r.get('gluon_int4_fp16_speedup_vs_sdpa', nan):>6.2f} "
              f"{r.get('gluon_int4_fp16_rel_err', nan):>7.1e} | {r.get('gluon_int8_fp16_us', nan):>7.1f} "
              f"{r.get('gluon_int8_fp16_pct_hbm', nan):>5.1f} {r.get('gluon_int8_fp16_speedup_vs_sdpa', nan):>6.2f} "
              f"{r.get('gluon_int8_fp16_rel_err', nan):>7.1e}")
    print("write, decode step (µs per layer):", [(w["batch"], round(w["us_per_layer"], 2),
          round(w["us_per_layer_with_rotation"], 2), w.get("bitwise_equal")) for w in write["decode"]])
    print("write, prefill (tokens/s):", [(w["tokens"], f"{w['tokens_per_s']:.3g}", w.get("bitwise_equal"))
                                         for w in write["prefill"]])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--quick", action="store_true", help="8k and 32k at batch 1 and 8 only")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--shapes", nargs="+", metavar="CTXxB",
                    help="attention table (and int8-variants) at these (context x batch) only, e.g. 131072x32 8192x1")
    ap.add_argument("--parts", nargs="+",
                    choices=("attention", "variants", "gluon-variants", "int8-variants", "extend", "write",
                             "write-variants"),
                    default=["attention", "variants", "gluon-variants", "int8-variants", "extend", "write",
                             "write-variants"],
                    help="which parts to run (default: all)")
    ap.add_argument("--profile", nargs=3, metavar=("CONTEXT", "BATCH", "KERNEL"),
                    help="only launch KERNEL (gluon, int8 or triton) 5 times at one shape, no graphs: for ncu")
    args = ap.parse_args(argv)
    if args.profile:
        return profile_launches(int(args.profile[0]), int(args.profile[1]), args.profile[2])
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    warnings.filterwarnings("ignore", message=".*(kernel not used|num_heads|runtime disabled).*")
    ctxs = (8192, 32768) if args.quick else (8192, 32768, 131072)
    batches = (1, 8) if args.quick else (1, 8, 32)
    command = " ".join(["python -m oscar_compile.bench.kernels", *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, "device": device_line(),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "shape": "Qwen3-8B layer H_q=32 H_kv=8 D=128",
              "sink": SINK, "recent": RECENT, "page": P, "bits": BITS, "group": GROUP,
              "hbm_bytes_per_s": HBM_BYTES_PER_S, "attention": [], "variants": []}
    shapes = ([tuple(int(x) for x in sh.split("x")) for sh in args.shapes] if args.shapes else
              [(ctx, B) for ctx in ctxs for B in batches if B * ctx <= 4 * 1024 * 1024])
    for ctx, B in shapes if "attention" in args.parts else ():
        result["attention"].append(bench_attention(ctx, B, not args.no_check))
        print(json.dumps(result["attention"][-1]), flush=True)
    if "variants" in args.parts:
        for ctx, B in ((8192, 1), (32768, 1), (131072, 1), (8192, 8), (32768, 32)):
            result["variants"] += bench_variants(ctx, B)
        print(json.dumps(result["variants"]), flush=True)
    if "gluon-variants" in args.parts and gluon_runs():
        result["gluon_variants"] = []
        for ctx, B in ((8192, 1), (8192, 8), (32768, 1), (32768, 8), (131072, 1), (131072, 32)):
            result["gluon_variants"] += bench_gluon_variants(ctx, B)
        print(json.dumps(result["gluon_variants"]), flush=True)
    if "int8-variants" in args.parts and gluon_runs():
        from oscar_compile.bench.kernels_int8 import bench_int8_variants

        result["int8_variants"] = []
        for ctx, B in (shapes if args.shapes else
                       ((8192, 1), (32768, 1), (131072, 1), (8192, 32), (32768, 32), (131072, 32))):
            result["int8_variants"] += bench_int8_variants(ctx, B, _decode_case(ctx, B))
        print(json.dumps(result["int8_variants"]), flush=True)
    if "extend" in args.parts:  # chunks 2 and 4 of an 8k prompt, one deep into a 32k prompt
        result["extend"] = [bench_extend(c, b, check=not args.no_check) for c, b in EXTEND_SHAPES]
        print(json.dumps(result["extend"]), flush=True)
    if "write-variants" in args.parts:
        result["write_variants"] = bench_write_variants()
        print(json.dumps(result["write_variants"]), flush=True)
    save_json(result, args.out)  # keep the attention numbers even if the write part fails
    result["write"] = {"decode": [], "prefill": []}
    try:
        if "write" in args.parts:
            result["write"] = bench_write(not args.no_check)
    except Exception as e:
        result["write"] = {"error": repr(e)[:1000], "decode": [], "prefill": []}
    save_json(result, args.out)
    print_table(result["attention"], result["write"])


if __name__ == "__main__":
    main()
