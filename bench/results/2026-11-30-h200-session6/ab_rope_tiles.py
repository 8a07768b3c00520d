"""Scratch (session 6): RoPE + rotation: dot precision and K block, against the torch reference."""
import json, sys, torch
from oscar_compile.bench.kernels import graph_time_us, H_Q, H_KV, D, LAYERS
from oscar_compile.kernels.elementwise_ref import rope_ref
from scratch.ew_var import rope_triton

dev = torch.device("cuda")
out = []
rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=dev, dtype=torch.float64))[0].float()
mean = torch.randn(H_KV, D, device=dev)
for B in (1, 8, 64):
    q = torch.randn(B, H_Q, 1, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, H_KV, 1, D, device=dev, dtype=torch.bfloat16)
    cos = torch.randn(1, 1, D, device=dev, dtype=torch.bfloat16)
    sin = torch.randn(1, 1, D, device=dev, dtype=torch.bfloat16)
    ref = rope_ref(q, k, cos, sin, rot, mean)
    row = {"batch": B}
    for prec in ("ieee", "tf32x3"):
        for bk in (32, 128):
            name = f"{prec}_bk{bk}"
            try:
                o = rope_triton(q, k, cos, sin, rot, mean, bk=bk, prec=prec)
                # differing bf16 outputs (one ulp: float32 summation order) and the largest gap
                row[name + "_ndiff"] = sum(int((a != b).sum()) for a, b in zip(o, ref))
                row[name + "_maxrel"] = max(((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-3)).max().item() for a, b in zip(o, ref))
                row[name] = round(graph_time_us([lambda: rope_triton(q, k, cos, sin, rot, mean, bk=bk, prec=prec)] * LAYERS), 3)
            except Exception as e:
                row[name + "_error"] = repr(e)[:300]
    print(json.dumps(row), flush=True); out.append(row)
json.dump(out, open(sys.argv[1], "w"), indent=1)
