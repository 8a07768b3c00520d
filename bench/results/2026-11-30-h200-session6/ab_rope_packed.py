"""Scratch (session 6): RoPE + rotation, tokens packed into the dot's 16 rows vs one token a program."""
import json, sys, torch
from oscar_compile.bench.kernels import graph_time_us, H_Q, H_KV, D, LAYERS
from oscar_compile.kernels.elementwise_ref import rope_ref
from oscar_compile.kernels.elementwise_triton import rope_triton as new
from scratch.ew_old import rope_triton as old

dev = torch.device("cuda")
out = []
rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=dev, dtype=torch.float64))[0].float()
mean = torch.randn(H_KV, D, device=dev)
for B, T in ((1, 1), (8, 1), (64, 1), (256, 1), (1, 2048), (1, 8192)):
    q = torch.randn(B, T, H_Q, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, T, H_KV, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    cos = torch.randn(1, T, D, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(1, T, D, device=dev, dtype=torch.bfloat16)
    ref = rope_ref(q, k, cos, sin, rot, mean)
    row = {"batch": B, "tokens": T}
    n = LAYERS if B * T < 4096 else 4
    for name, fn in (("old", old), ("new", new)):
        o = fn(q, k, cos, sin, rot, mean)
        row[name + "_ndiff_vs_ref"] = sum(int((a != b).sum()) for a, b in zip(o, ref))
        row[name + "_max_abs_diff"] = max((a.float() - b.float()).abs().max().item() for a, b in zip(o, ref))
        row[name + "_us"] = round(graph_time_us([lambda: fn(q, k, cos, sin, rot, mean)] * n, reps=10), 2)
    row["no_rot_us"] = round(graph_time_us([lambda: new(q, k, cos, sin)] * n, reps=10), 2)
    print(json.dumps(row), flush=True); out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
