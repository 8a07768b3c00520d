"""Scratch A/B (session 7): INT2 decode kernel, warps x history block at equal occupancy (nsplit scaled
so that 2-warp programs fill the GPU as 4-warp ones do; session 6's sweep kept the 4-warp split count)."""
import json, sys, torch
from oscar_compile.bench.kernels import (graph_time_us, int2_layer, num_buffers, int2_bytes, SINK, RECENT, BITS,
                                         GROUP, H_Q, H_KV, D, P)
from oscar_compile.kernels.attention_triton import attention_triton as at, plan_launch

out = []
dev = torch.device("cuda")
for ctx, B in ((131072, 1), (32768, 1), (8192, 1), (131072, 8), (32768, 8), (32768, 32)):
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(num_buffers(int2_bytes(B, ctx, torch.float16)))]
    max_hist = layers[0][1][1].shape[1] * P
    planned = plan_launch(B, B, H_KV, H_Q // H_KV, max_hist, dev, 128, min_split_blocks=2)[2]
    row = {"context": ctx, "batch": B, "planned_nsplit": planned}
    variants = [("w4_n128", {})]
    for mult in (1.5, 2):
        ns = max(1, int(planned * mult))
        variants += [(f"w2_n64_ns{ns}", dict(num_warps=2, block_n=64, nsplit=ns)),
                     (f"w4_n128_ns{ns}", dict(nsplit=ns))]
    variants += [("w2_n64_r96_ns%d" % (3 * planned), dict(num_warps=2, block_n=64, nsplit=3 * planned, maxnreg=96))]
    args = lambda p, tb: (q, kn, kn, cu, lens, *tb, *p, D ** -0.5, SINK, RECENT, BITS, GROUP)
    ref = at(*args(*layers[0]))
    for rep in range(2):
        for name, kw in variants:
            try:
                t = graph_time_us([lambda p=p, tb=tb: at(*args(p, tb), **kw) for p, tb in layers])
                row[f"{name}_{rep}"] = round(t, 2)
                if rep == 0:
                    o = at(*args(*layers[0]), **kw)
                    row[f"{name}_diff"] = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            except Exception as e:
                row[f"{name}_error"] = repr(e)[:300]
    print(json.dumps(row), flush=True); out.append(row)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
    del layers; torch.cuda.empty_cache()
