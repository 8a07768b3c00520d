"""Scratch: paged BF16 decode kernel at 9751379 vs working tree (and launch variants), one run."""
import json, sys, torch
from oscar_compile.bench.kernels import graph_time_us, num_buffers, make_tables, H_Q, H_KV, D, P
from oscar_compile.kernels.attention_bf16_triton import attention_bf16_triton as new
from scratch.bf16_97 import attention_bf16_triton as old

variants = [("old97", old, {}), ("new", new, {}), ("new_s3", new, {"num_stages": 3}), ("new_w8", new, {"num_warps": 8}),
            ("new_n32", new, {"block_n": 32}), ("new_n128", new, {"block_n": 128}), ("old97_s3", old, {"num_stages": 3})]
rows = []
dev = torch.device("cuda")
for ctx, B in ((32768, 1), (131072, 1), (131072, 8), (8192, 1), (32768, 32)):
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    nb = num_buffers(B * H_KV * ctx * 2 * D * 2)
    pages = [(torch.randn(B * ctx // P, H_KV, P, D, device=dev, dtype=torch.bfloat16),
              torch.randn(B * ctx // P, H_KV, P, D, device=dev, dtype=torch.bfloat16),
              make_tables(B, ctx // P, dev)) for _ in range(nb)]
    row = {"context": ctx, "batch": B}
    for rep in range(2):
        for name, fn, kw in variants:
            try:
                t = graph_time_us([lambda kp=kp, vp=vp, pt=pt: fn(q, kn, kn, cu, lens, pt, kp, vp, D ** -0.5, **kw)
                                   for kp, vp, pt in pages])
                row[f"{name}_{rep}"] = round(t, 2)
            except Exception as e:
                row[f"{name}_{rep}"] = repr(e)[:200]
    print(json.dumps(row), flush=True)
    rows.append(row)
    del pages
    torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)
