# Scratch comparison used for runs 1-2 (see README): "old" is kernels/attention_triton.py and
# attention_blocks_triton.py at commit b2ecab7, copied to scratch/old_attn.py / scratch/old_blocks.py
# (the former importing the latter); "new" is the working tree. Usage: python compare_int2_kernels.py OUT.json
"""Scratch: old vs new INT2 decode kernel side by side (one run), plus GPU correctness."""
import json, os, sys, torch
from oscar_compile.bench.kernels import (graph_time_us, int2_layer, num_buffers, int2_bytes, rel_err,
                                         SINK, RECENT, BITS, GROUP, H_Q, H_KV, D, P, HBM_BYTES_PER_S)
from oscar_compile.kernels.attention_triton import attention_triton as new
from oscar_compile.kernels.attention_ref import attention_ref
from scratch.old_attn import attention_triton as old

shapes = [(8192, 1), (32768, 1), (131072, 1), (8192, 32), (32768, 8), (32768, 32), (131072, 8), (131072, 32)]
if len(sys.argv) > 2:
    shapes = [tuple(map(int, s.split("x"))) for s in sys.argv[2].split(",")]
variants = [("old", old, {}), ("new", new, {}), ("new_r128", new, {"maxnreg": 128}), ("new_r128_s3", new, {"maxnreg": 128, "num_stages": 3})]
rows = []
dev = torch.device("cuda")
for ctx, B in shapes:
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    for sdt in (torch.float16, torch.float32):
        nbytes = int2_bytes(B, ctx, sdt)
        layers = [int2_layer(B, ctx, sdt, dev) for _ in range(num_buffers(nbytes))]
        p0, (wt, qt) = layers[0]
        want = attention_ref(q[:1], kn[:1], kn[:1], cu[:2], lens[:1], wt[:1], qt[:1], *p0, D ** -0.5,
                             SINK, RECENT, BITS, GROUP)
        row = {"context": ctx, "batch": B, "scale_dtype": str(sdt)}
        for name, fn, kw in variants:
            if sdt == torch.float32 and name not in ("old", "new_r128"):
                continue
            call = lambda p, tb: fn(q, kn, kn, cu, lens, *tb, *p, D ** -0.5, SINK, RECENT, BITS, GROUP, **kw)
            try:
                t = graph_time_us([lambda p=p, tb=tb: call(p, tb) for p, tb in layers])
                got = call(p0, (wt, qt))[:1]
                row[name] = {"us": round(t, 2), "pct_hbm": round(100 * nbytes / (t * 1e-6) / HBM_BYTES_PER_S, 1),
                             "rel_err": rel_err(got, want)}
            except Exception as e:
                row[name] = {"error": repr(e)[:300]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del layers
        torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)
