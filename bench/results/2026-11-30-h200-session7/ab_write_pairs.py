"""Scratch A/B (session 7): cache-write clip threshold, two bits a round vs one (bisection), vs no clip."""
import json, sys, torch
from oscar_compile.bench.kernels import graph_time_us, int2_layer, decode_write_inputs, SINK, RECENT, BITS, GROUP, H_KV, D, LAYERS
from oscar_compile.kernels.cache_write_triton import cache_write_triton as cw_pairs
from scratch.cw_bisect import cache_write_triton as cw_bisect

out = {"decode": [], "prefill": []}
dev = torch.device("cuda")

def dump():
    json.dump(out, open(sys.argv[1], "w"), indent=1)

for B in (1, 8, 32, 64):
    k, v, args = decode_write_inputs(B, dev)
    noclip = args[:-2] + (1.0, 1.0)
    pools = args[4:12]
    row = {"batch": B}
    for rep in range(3):
        for name, fn, a in (("bisect", cw_bisect, args), ("pairs", cw_pairs, args), ("noclip", cw_pairs, noclip)):
            row[f"{name}_{rep}"] = round(graph_time_us([lambda: fn(k, v, *a)] * LAYERS), 3)
    snap = [x.clone() for x in pools]
    cw_bisect(k, v, *args); a = [x.clone() for x in pools]
    for x, s in zip(pools, snap): x.copy_(s)
    cw_pairs(k, v, *args); b = [x.clone() for x in pools]
    row["bitwise_equal_bisect_pairs"] = all(torch.equal(x, y) for x, y in zip(a, b))
    print(json.dumps(row), flush=True); out["decode"].append(row); dump()
for B, T in ((1, 32768), (8, 4096)):
    N = B * T
    pools, (wt, qt) = int2_layer(B, T, torch.float16, dev)
    k = torch.randn(N, H_KV, D, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    cu = torch.arange(B + 1, device=dev, dtype=torch.int32) * T
    lens = torch.zeros(B, device=dev, dtype=torch.int32)
    args = (cu, lens, wt, qt, *pools, SINK, RECENT, BITS, GROUP, 0.96, 0.92)
    row = {"batch": B, "tokens": N}
    for rep in range(2):
        for name, fn in (("bisect", cw_bisect), ("pairs", cw_pairs)):
            row[f"{name}_Mtok_s_{rep}"] = round(N / graph_time_us([lambda: fn(k, v, *args)], reps=10), 2)
    print(json.dumps(row), flush=True); out["prefill"].append(row); dump()
