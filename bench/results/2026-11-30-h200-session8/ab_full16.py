"""A layer kept at 16 bits beside INT2 layers (the INT-b op with bits = 16: windows + 16-bit
history) against the BF16 mode's kernel (every token in a full-precision page) and INT2."""
import json, sys
import torch
from oscar_compile.bench.kernels import graph_time_us, make_tables, int2_layer, H_Q, H_KV, D, SINK, RECENT, P
from oscar_compile.kernels.attention_triton import attention_triton
from oscar_compile.kernels.attention_bf16_triton import attention_bf16_triton
from oscar_compile.kernels.pools import allocate_pools


def main(out):
    dev = torch.device("cuda")
    rows = []
    for ctx, B in ((8192, 8), (32768, 1), (32768, 8), (131072, 1)):
        hist = ctx - SINK - RECENT
        qp, wp = -(-hist // P), (SINK + RECENT) // P
        pools = allocate_pools(B * qp, B * wp, H_KV, P, D, 16, 128, torch.float16, torch.bfloat16, dev)
        for t in (pools.k_win, pools.v_win, pools.k_codes, pools.v_codes):
            t.copy_(torch.randn(t.shape, device=dev))
        wt, qt = make_tables(B, wp, dev), make_tables(B, qp, dev)
        fp = -(-ctx // P)
        kp = torch.randn(B * fp, H_KV, P, D, device=dev, dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        pt = make_tables(B, fp, dev)
        q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
        lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
        args16 = (q, k, v, cu, lens, wt, qt, *pools, D ** -0.5, SINK, RECENT, 16, 128)
        t16 = graph_time_us([lambda: attention_triton(*args16)])
        t16cap = graph_time_us([lambda: attention_triton(*args16, prefill_maxnreg=128)])
        tbf = graph_time_us([lambda: attention_bf16_triton(q, k, v, cu, lens, pt, kp, vp, D ** -0.5)])
        i2, (wt2, qt2) = int2_layer(B, ctx, torch.float16, dev)
        tint2 = graph_time_us([lambda: attention_triton(q, k, v, cu, lens, wt2, qt2, *i2, D ** -0.5, SINK, RECENT, 2, 128)])
        row = dict(context=ctx, batch=B, full16_us=t16, full16_capped128_us=t16cap, paged_bf16_us=tbf, int2_us=tint2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
