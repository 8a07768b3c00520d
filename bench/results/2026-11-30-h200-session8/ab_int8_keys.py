"""A/B: the INT2 decode kernel with int8 key dots (q quantized per row) against the kernel."""
import json, sys
import torch
from oscar_compile.bench.kernels import graph_time_us, int2_layer, int2_bytes, num_buffers, H_Q, H_KV, D, SINK, RECENT
from oscar_compile.kernels.attention_triton import attention_triton
from scratch.attn_i8 import attention_triton as att_i8


def main(out):
    dev = torch.device("cuda")
    rows = []
    for ctx, B in ((8192, 32), (32768, 1), (32768, 8), (32768, 32), (131072, 1), (131072, 8)):
        n = num_buffers(int2_bytes(B, ctx, torch.float16))
        layers = [int2_layer(B, ctx, torch.float16, dev) for _ in range(n)]
        q = torch.randn(B, H_Q, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, H_KV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
        lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)

        def call(f, pools, tables):
            return f(q, k, v, cu, lens, tables[0], tables[1], *pools, D ** -0.5, SINK, RECENT, 2, 128)

        base = graph_time_us([lambda p=p, t=t: call(attention_triton, p, t) for p, t in layers])
        i8 = graph_time_us([lambda p=p, t=t: call(att_i8, p, t) for p, t in layers])
        base2 = graph_time_us([lambda p=p, t=t: call(attention_triton, p, t) for p, t in layers])
        a, b = call(attention_triton, *layers[0]).float(), call(att_i8, *layers[0]).float()
        row = dict(context=ctx, batch=B, kernel_us=base, kernel_again_us=base2, int8_keys_us=i8,
                   rel_diff=((a - b).norm() / a.norm()).item())
        print(json.dumps(row), flush=True)
        rows.append(row)
        del layers
        torch.cuda.empty_cache()
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
