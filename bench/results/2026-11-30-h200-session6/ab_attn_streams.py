"""Scratch (session 6): INT2 decode kernel vs the padding-rows-as-streams prototype (scratch/blocks_s.py)."""
import json, sys, torch
from oscar_compile.bench.kernels import graph_time_us, int2_layer, num_buffers, int2_bytes, SINK, RECENT, BITS, GROUP, H_Q, H_KV, D
from oscar_compile.kernels.attention_triton import attention_triton as cur
from scratch.attn_s import attention_triton as streams

out = []
dev = torch.device("cuda")
for ctx, B in ((131072, 1), (8192, 1), (32768, 1), (131072, 8), (32768, 32), (8192, 32)):
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(num_buffers(int2_bytes(B, ctx, torch.float16)))]
    row = {"context": ctx, "batch": B}
    args0 = (q, kn, kn, cu, lens, *layers[0][1], *layers[0][0], D ** -0.5, SINK, RECENT, BITS, GROUP)
    ref = cur(*args0)
    for name, fn, kw in (("cur", cur, {}), ("streams", streams, {}), ("streams_r168", streams, {"maxnreg": 168})):
        try:
            o = fn(*args0, **kw)
            row[name + "_diff"] = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            for rep in range(2):
                row[f"{name}_{rep}"] = round(graph_time_us([lambda p=p, tb=tb: fn(q, kn, kn, cu, lens, *tb, *p, D ** -0.5, SINK, RECENT,
                                                                     BITS, GROUP, **kw) for p, tb in layers]), 2)
        except Exception as e:
            row[name + "_error"] = repr(e)[:300]
    print(json.dumps(row), flush=True); out.append(row)
    del layers; torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
