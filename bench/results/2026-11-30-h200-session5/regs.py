import json, torch
from oscar_compile.bench.kernels import graph_time_us, int2_layer, num_buffers, int2_bytes, SINK, RECENT, BITS, GROUP, H_Q, H_KV, D
from oscar_compile.kernels.attention_triton import attention_triton
dev = torch.device("cuda")
for ctx, B, combos in ((131072, 1, [(128, None), (96, None), (96, 80), (128, 64)]), (32768, 1, [(128, None), (96, None)]),
                       (131072, 32, [(128, None), (96, None)])):
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(num_buffers(int2_bytes(B, ctx, torch.float16)))]
    row = {"context": ctx, "batch": B}
    for rep in range(2):
        for r, ns in combos:
            t = graph_time_us([lambda p=p, tb=tb: attention_triton(q, kn, kn, cu, lens, *tb, *p, D ** -0.5, SINK, RECENT,
                               BITS, GROUP, maxnreg=r, nsplit=ns) for p, tb in layers])
            row[f"r{r}_n{ns}_{rep}"] = round(t, 2)
    print(json.dumps(row), flush=True)
    del layers
    torch.cuda.empty_cache()
