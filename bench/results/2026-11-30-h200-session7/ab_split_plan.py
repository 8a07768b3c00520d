"""Scratch A/B (session 7): decode split count. plan_launch takes cdiv(4 * SMs, programs) splits, so
e.g. batch 8 gets 9 x 64 history programs on 528 slots (a second, nearly empty wave). Variants: floor
(whole waves of history programs), floor after the window programs, and fixed multiples."""
import json, sys, torch, triton
import oscar_compile.kernels.attention_bf16_triton as abf
from oscar_compile.kernels import attention_triton as at
from oscar_compile.bench.kernels import (graph_time_us, int2_layer, num_buffers, int2_bytes, make_tables, SINK, RECENT,
                                         BITS, GROUP, H_Q, H_KV, D, P)

dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count
orig_plan = at.plan_launch


def plan_rule(rule):
    def plan(N, B, H_kv, g, max_hist, device, block_n=64, min_split_blocks=4, prefill_rows=64):
        bm, rows, ns = orig_plan(N, B, H_kv, g, max_hist, device, block_n, min_split_blocks, prefill_rows)
        if rule == "cur" or not ns or bm != 1:
            return bm, rows, ns
        programs = N * H_kv
        prec = triton.cdiv(max_hist, at.MAX_SPLIT_TOKENS) if max_hist > at.MAX_SPLIT_TOKENS else 0
        blocks = triton.cdiv(max_hist, block_n)
        slots = 4 * sms - (programs if rule == "floor_win" else 0)
        n = max(1, min(slots // programs, max(1, blocks // min_split_blocks)))
        n = triton.cdiv(blocks, triton.cdiv(blocks, n))
        return bm, rows, max(n, prec)
    return plan


out = []
scale = D ** -0.5
for ctx, B in ((8192, 8), (32768, 8), (8192, 16), (8192, 32), (32768, 32), (8192, 64), (131072, 8), (8192, 1), (131072, 1)):
    q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    row = {"context": ctx, "batch": B}
    layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(num_buffers(int2_bytes(B, ctx, torch.float16)))]
    max_hist = layers[0][1][1].shape[1] * P
    for rule in ("cur", "floor", "floor_win"):
        row[f"int2_{rule}_nsplit"] = plan_rule(rule)(B, B, H_KV, H_Q // H_KV, max_hist, dev, 128, 2)[2]
    ref = at.attention_triton(q, kn, kn, cu, lens, *layers[0][1], *layers[0][0], scale, SINK, RECENT, BITS, GROUP)
    for rep in range(2):
        for rule in ("cur", "floor", "floor_win"):
            at.plan_launch = plan_rule(rule)
            t = graph_time_us([lambda p=p, tb=tb: at.attention_triton(q, kn, kn, cu, lens, *tb, *p, scale, SINK, RECENT,
                                                                      BITS, GROUP) for p, tb in layers])
            row[f"int2_{rule}_{rep}"] = round(t, 2)
            if rep == 0:
                o = at.attention_triton(q, kn, kn, cu, lens, *layers[0][1], *layers[0][0], scale, SINK, RECENT, BITS, GROUP)
                row[f"int2_{rule}_diff"] = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            at.plan_launch = orig_plan
    del layers
    nb = num_buffers(B * H_KV * ctx * 2 * D * 2)
    pages = [(torch.randn(B * ctx // P, H_KV, P, D, device=dev, dtype=torch.bfloat16),
              torch.randn(B * ctx // P, H_KV, P, D, device=dev, dtype=torch.bfloat16),
              make_tables(B, ctx // P, dev)) for _ in range(nb)]
    for rule in ("cur", "floor", "floor_win"):
        row[f"bf16_{rule}_nsplit"] = plan_rule(rule)(B, B, H_KV, H_Q // H_KV, ctx, dev, 64)[2]
    for rep in range(2):
        for rule in ("cur", "floor", "floor_win"):
            abf.plan_launch = plan_rule(rule)
            t = graph_time_us([lambda kp=kp, vp=vp, pt=pt: abf.attention_bf16_triton(q, kn, kn, cu, lens, pt, kp, vp, scale)
                               for kp, vp, pt in pages])
            row[f"bf16_{rule}_{rep}"] = round(t, 2)
            abf.plan_launch = orig_plan
    del pages
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True); out.append(row)
    json.dump(out, open(sys.argv[1], "w"), indent=1)
