"""Scratch (session 6): INT2 decode kernel warps x history block sweep; RoPE+rotation column split."""
import json, sys, torch
from oscar_compile.bench.kernels import (graph_time_us, int2_layer, num_buffers, int2_bytes,
                                         SINK, RECENT, BITS, GROUP, H_Q, H_KV, D, LAYERS, P)
from oscar_compile.kernels.attention_triton import attention_triton
from oscar_compile.kernels.elementwise_triton import rope_triton

out = {"attention": [], "rope": []}
dev = torch.device("cuda")
def dump(): json.dump(out, open(sys.argv[1], "w"), indent=1)

rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=dev, dtype=torch.float64))[0].float()
mean = torch.randn(H_KV, D, device=dev)
for B in (1, 8, 64, 256):
    q = torch.randn(B, H_Q, 1, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, H_KV, 1, D, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(1, 1, D, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(1, 1, D, device=dev, dtype=torch.bfloat16)
    row = {"batch": B}
    ref = rope_triton(q, k, cos, sin, rot, mean, col_blocks=1)
    for rep in range(2):
        for name, kw in (("whole", {"col_blocks": 1}), ("planned", {}), ("c4", {"col_blocks": 4}), ("c8", {"col_blocks": 8})):
            row[f"{name}_{rep}"] = round(graph_time_us([lambda: rope_triton(q, k, cos, sin, rot, mean, **kw)] * LAYERS), 3)
            if rep == 0:
                o = rope_triton(q, k, cos, sin, rot, mean, **kw)
                row[f"{name}_equal"] = all(torch.equal(a, b) for a, b in zip(o, ref))
    row["no_rot"] = round(graph_time_us([lambda: rope_triton(q, k, cos, sin)] * LAYERS), 3)
    print(json.dumps(row), flush=True); out["rope"].append(row); dump()

for ctx, B in ((131072, 1), (8192, 1), (131072, 8), (32768, 32)):
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(num_buffers(int2_bytes(B, ctx, torch.float16)))]
    row = {"context": ctx, "batch": B}
    ref = attention_triton(q, kn, kn, cu, lens, *layers[0][1], *layers[0][0], D ** -0.5, SINK, RECENT, BITS, GROUP)
    for nw, bn, reg in ((4, 128, 128), (2, 64, 128), (2, 128, 128), (2, 64, 168), (8, 128, 128), (8, 256, 128), (4, 64, 128)):
        name = f"w{nw}_n{bn}_r{reg}"
        kw = dict(num_warps=nw, block_n=bn, maxnreg=reg)
        try:
            o = attention_triton(q, kn, kn, cu, lens, *layers[0][1], *layers[0][0], D ** -0.5, SINK, RECENT, BITS, GROUP, **kw)
            row[name + "_diff"] = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            row[name] = round(graph_time_us([lambda p=p, tb=tb: attention_triton(q, kn, kn, cu, lens, *tb, *p, D ** -0.5, SINK, RECENT,
                                                                         BITS, GROUP, **kw) for p, tb in layers]), 2)
        except Exception as e:
            row[name + "_error"] = repr(e)[:300]
    print(json.dumps(row), flush=True); out["attention"].append(row); dump()
    del layers; torch.cuda.empty_cache()
