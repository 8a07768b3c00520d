"""Scratch: INT2 decode kernel at ea6c22c / f509157 / working tree, side by side in one run."""
import json, sys, torch
from oscar_compile.bench.kernels import (graph_time_us, int2_layer, num_buffers, int2_bytes,
                                         SINK, RECENT, BITS, GROUP, H_Q, H_KV, D)
from oscar_compile.kernels.attention_triton import attention_triton as new
from scratch.attn_ea6c22c import attention_triton as ea
from scratch.attn_f509157 import attention_triton as f5

shapes = [(8192, 32), (32768, 32), (131072, 32), (32768, 8), (131072, 1), (8192, 1)]
rows = []
dev = torch.device("cuda")
for ctx, B in shapes:
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(num_buffers(int2_bytes(B, ctx, torch.float16)))]
    row = {"context": ctx, "batch": B}
    for rep in range(2):  # twice, interleaved: drift shows up as a difference between reps
        for name, fn in (("ea6c22c", ea), ("f509157", f5), ("new", new)):
            t = graph_time_us([lambda p=p, tb=tb: fn(q, kn, kn, cu, lens, *tb, *p, D ** -0.5, SINK, RECENT,
                                                     BITS, GROUP) for p, tb in layers])
            row[f"{name}_{rep}"] = round(t, 2)
    print(json.dumps(row), flush=True)
    rows.append(row)
    del layers
    torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)
