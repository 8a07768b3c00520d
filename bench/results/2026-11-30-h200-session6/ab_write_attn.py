"""Scratch A/B (session 6): cache write sort vs bisection clip; INT2 decode kernel vs warp-split variant."""
import json, sys, time, torch
from oscar_compile.bench.kernels import (graph_time_us, int2_layer, num_buffers, int2_bytes, decode_write_inputs,
                                         SINK, RECENT, BITS, GROUP, H_Q, H_KV, D, LAYERS, P)
from oscar_compile.kernels.cache_write_triton import cache_write_triton as cw_new
from scratch.cw_sort import cache_write_triton as cw_sort
from oscar_compile.kernels.attention_triton import attention_triton as at_cur, plan_launch
from scratch.attn_w import attention_triton as at_w

out = {"write": [], "prefill": [], "attention": []}
dev = torch.device("cuda")
part = sys.argv[2] if len(sys.argv) > 2 else "all"

def dump():
    json.dump(out, open(sys.argv[1], "w"), indent=1)

if part in ("all", "write"):
    rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=dev, dtype=torch.float64))[0].float()
    mean = torch.randn(H_KV, D, device=dev)
    for B in (1, 8, 32, 64):
        k, v, args = decode_write_inputs(B, dev)
        pools = args[4:12]
        row = {"batch": B}
        for rep in range(2):
            for name, fn in (("sort", cw_sort), ("bisect", cw_new)):
                row[f"{name}_{rep}"] = round(graph_time_us([lambda: fn(k, v, *args)] * LAYERS), 3)
        row["unfused_rot"] = round(graph_time_us([lambda: cw_new(k, v, *args, rot_k=rot, mean_k=mean)] * LAYERS), 3)
        try:
            row["fused_rot"] = round(graph_time_us([lambda: cw_new(k, v, *args, rot_k=rot, mean_k=mean, fuse_rotation=True)] * LAYERS), 3)
        except Exception as e:
            row["fused_rot_error"] = repr(e)[:300]
        # bitwise: both clips write the same codes / scales / zeros / windows
        snap = [x.clone() for x in pools]
        cw_sort(k, v, *args); a = [x.clone() for x in pools]
        for x, s in zip(pools, snap): x.copy_(s)
        cw_new(k, v, *args); b = [x.clone() for x in pools]
        row["bitwise_equal_sort_bisect"] = all(torch.equal(x, y) for x, y in zip(a, b))
        print(json.dumps(row), flush=True); out["write"].append(row); dump()
    for B, T in ((1, 32768), (8, 4096)):
        N = B * T
        pools, (wt, qt) = int2_layer(B, T, torch.float16, dev)
        k = torch.randn(N, H_KV, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
        cu = torch.arange(B + 1, device=dev, dtype=torch.int32) * T
        lens = torch.zeros(B, device=dev, dtype=torch.int32)
        args = (cu, lens, wt, qt, *pools, SINK, RECENT, BITS, GROUP, 0.96, 0.92)
        row = {"batch": B, "tokens": N}
        for name, fn, kw in (("sort_bt8", cw_sort, {}), ("bisect_bt8", cw_new, {}), ("bisect_bt16", cw_new, {"block_t": 16})):
            try:
                t = graph_time_us([lambda: fn(k, v, *args, **kw)], reps=10)
                row[name + "_Mtok_s"] = round(N / t, 2)
            except Exception as e:
                row[name + "_error"] = repr(e)[:300]
        print(json.dumps(row), flush=True); out["prefill"].append(row); dump()

if part in ("all", "attention"):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ctx, B in ((131072, 1), (8192, 1), (32768, 1), (131072, 8), (32768, 32), (8192, 32), (32768, 8)):
        q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
        kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
        cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
        lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
        layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(num_buffers(int2_bytes(B, ctx, torch.float16)))]
        max_hist = layers[0][1][1].shape[1] * P
        planned = plan_launch(B, B, H_KV, H_Q // H_KV, max_hist, dev, 128, min_split_blocks=2)[2]
        row = {"context": ctx, "batch": B, "planned_nsplit": planned}
        variants = [("cur", at_cur, {}), ("w168", at_w, {"maxnreg": 168}), ("wfree", at_w, {"maxnreg": None})]
        if planned:
            variants.append(("w168_3q", at_w, {"maxnreg": 168, "nsplit": max(1, planned * 3 // 4)}))
        ref = at_cur(q, kn, kn, cu, lens, *layers[0][1], *layers[0][0], D ** -0.5, SINK, RECENT, BITS, GROUP)
        for rep in range(2):
            for name, fn, kw in variants:
                try:
                    t = graph_time_us([lambda p=p, tb=tb: fn(q, kn, kn, cu, lens, *tb, *p, D ** -0.5, SINK, RECENT,
                                                             BITS, GROUP, **kw) for p, tb in layers])
                    row[f"{name}_{rep}"] = round(t, 2)
                    if rep == 0:
                        o = fn(q, kn, kn, cu, lens, *layers[0][1], *layers[0][0], D ** -0.5, SINK, RECENT, BITS, GROUP, **kw)
                        row[f"{name}_diff"] = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                except Exception as e:
                    row[f"{name}_error"] = repr(e)[:300]
        print(json.dumps(row), flush=True); out["attention"].append(row); dump()
        del layers; torch.cuda.empty_cache()
dump()
