"""RoPE with the OSCAR rotation at a prefill step: tilings and precisions, on GPU.

    python -m oscar_compile.bench.rope [--tokens 8192] [--out rope.json]

INT2's 8192-token step spent 16 ms in RoPE with the query and key rotation folded in, against 3.4
in the BF16 mode's plain RoPE (bench/results/2026-12-07-gpu-int2-prefill-step, call 29); this part
times one Qwen3-8B layer's ``rope_triton`` call (32 query heads, 8 KV heads, head_dim 128, per-head
rotations, centred keys) replayed from a CUDA graph, for each precision (``rope_precision``: the
float32 products of ``ieee``, the exact bf16 parts of ``bf16x3``) and tiling (rows per program,
column blocks, warps) of :data:`VARIANTS`, beside RoPE without the rotation (its floor), with each
variant's error against a float64 rotation of the same RoPE'd values and the share of outputs that
differ from ``ieee``'s.
"""
from __future__ import annotations

import argparse
import sys

import torch

from oscar_compile.bench.kernel_setup import H_KV, H_Q, D, graph_time_us
from oscar_compile.evaluation.result_file import save_json
from oscar_compile.kernels.elementwise import elementwise_triton as ew

# (precision, rows per program, column blocks (None: planned), warps)
VARIANTS = [("ieee", 16, None, 4), ("ieee", 32, None, 4), ("ieee", 32, 2, 8), ("ieee", 64, 2, 8),
            ("bf16x3", 32, 1, 4), ("bf16x3", 64, 1, 4), ("bf16x3", 64, 1, 8), ("bf16x3", 64, 2, 4),
            ("bf16x3", 128, 1, 8), ("bf16x3", 128, 2, 8), ("bf16x3", 16, 1, 4)]


def rope_inputs(tokens: int, device, seed: int = 0) -> tuple:
    """(q, k, cos, sin, rot, mean) of one layer: bf16 q [1, H_q, T, D], k [1, H_kv, T, D], the
    cos / sin of random angles, orthogonal float32 rotations per KV head and a key mean."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, H_Q, tokens, D, device=device, generator=gen).bfloat16()
    k = torch.randn(1, H_KV, tokens, D, device=device, generator=gen).bfloat16()
    angle = torch.rand(1, tokens, D // 2, device=device, generator=gen) * 6.28
    cos, sin = (torch.cat([f(angle)] * 2, -1).bfloat16() for f in (torch.cos, torch.sin))
    rot = torch.linalg.qr(torch.randn(H_KV, D, D, device=device, dtype=torch.float64, generator=gen))[0].float()
    mean = 2 * torch.randn(H_KV, D, device=device, generator=gen)
    return q, k, cos, sin, rot, mean


def exact_rotation(q, k, cos, sin, rot, mean) -> list[torch.Tensor]:
    """[T, H, D] float64 rotations of the RoPE'd values the kernel rotates (its own output without
    the rotation: the bf16 values it rounds RoPE to)."""
    qr, kr = ew.rope_triton(q, k, cos, sin)
    g = q.shape[1] // k.shape[1]
    return [torch.einsum("bhtd,hde->bthe", qr.double(), rot.double().repeat_interleave(g, 0))[0],
            torch.einsum("bhtd,hde->bthe", kr.double() - mean.double()[None, :, None, :], rot.double())[0]]


def rotation_errors(got, ieee, exact) -> list[dict]:
    """Per output (q, k): max abs and relative Frobenius error against float64, the share of
    elements that differ from the ieee path's."""
    out = []
    for g, w, e in zip(got, ieee, exact, strict=True):
        g, w = g.transpose(1, 2)[0], w.transpose(1, 2)[0]
        out.append(dict(max_abs_vs_fp64=(g.double() - e).abs().max().item(),
                        rel_fro_vs_fp64=((g.double() - e).norm() / e.norm()).item(),
                        differ_from_ieee=(g != w).double().mean().item()))
    return out


def bench(tokens: int) -> list[dict]:
    args = rope_inputs(tokens, torch.device("cuda"))
    q, k, cos, sin, rot, mean = args
    ieee = ew.rope_triton(*args, precision="ieee")
    exact = exact_rotation(*args)
    rows = [dict(variant="no rotation", us=graph_time_us([lambda: ew.rope_triton(q, k, cos, sin)], reps=20))]
    for precision, rows_pp, col_blocks, warps in VARIANTS:
        kw = dict(precision=precision, rows_per_program=rows_pp, col_blocks=col_blocks, num_warps=warps)
        try:
            us = graph_time_us([lambda kw=kw: ew.rope_triton(*args, **kw)], reps=20)
            rows.append(dict(variant=kw, us=us, errors=rotation_errors(ew.rope_triton(*args, **kw), ieee, exact)))
        except Exception as e:  # a tiling that does not compile (registers, shared memory)
            rows.append(dict(variant=kw, error=repr(e)[:300]))
        print(rows[-1], flush=True)
    rows.append(dict(variant="default", us=graph_time_us([lambda: ew.rope_triton(*args)], reps=20),
                     errors=rotation_errors(ew.rope_triton(*args), ieee, exact)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the prefill step")
    ap.add_argument("--out", default="bench_rope.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    from oscar_compile.bench.kernels import device_line

    command = " ".join(["python -m oscar_compile.bench.rope", *(argv if argv is not None else sys.argv[1:])])
    save_json(dict(command=command, device=device_line(), tokens=args.tokens, rows=bench(args.tokens)), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
