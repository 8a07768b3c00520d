"""Host time of one ``oscar::attention`` CUDA call without its launches, on a CPU.

The dispatch (``attention_dispatch.attention_cuda``) and the kernel wrappers run as on an H200:
``gluon_device_problem`` says sm_90, ``num_sms`` says 132, and the Triton / Gluon launches and
the merges are stubs that return at once. What is timed is the Python between the op's entry
and its launches: the kernel choice, the wrapper's checks, its launch plan and the partial
buffers (torch.empty on the CPU here, the caching allocator on CUDA).

    PYTHONPATH=<checkout> OMP_NUM_THREADS=1 python3 host_plan_cpu.py [--layers 32] [--steps 200]

Run it against two checkouts (before / after) and compare; it prints one JSON line per case.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from oscar_compile.formats.op_args import AttentionArgs
from oscar_compile.kernels import attention_dispatch as ad
from oscar_compile.kernels import attention_gluon as kg
from oscar_compile.kernels import attention_gluon_int8 as k8
from oscar_compile.kernels import attention_triton as kt


class _NoLaunch:
    """Stands for a jitted kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _emulate_h200() -> None:
    ad.gluon_device_problem = lambda index: None
    for mod in (k8, kg, kt):
        mod.num_sms = lambda device: 132
    k8._decode_int8_kernel = kg._decode_kernel = _NoLaunch()
    kt._attn_kernel = kt._attn_kernel_prefill = _NoLaunch()
    for mod in (k8, kg, kt):
        mod.merge_partials = lambda *args, **kwargs: None
    kt.merge_partials_in_order = lambda *args, **kwargs: None


def decode_args(B: int, ctx: int, bits: int, D: int = 128, H_q: int = 32, H_kv: int = 8, P: int = 16,
                sink: int = 64, recent: int = 256, N: int | None = None) -> AttentionArgs:
    """A step of B sequences of ``ctx`` tokens, Llama-3-8B-like heads: one new token each (decode),
    or N new tokens in all."""
    N = B if N is None else N
    wdt = torch.bfloat16
    hist_pages = -(-(ctx - sink - recent) // P)
    win_cols = (sink + recent) // P
    nq, nw = B * hist_pages, B * win_cols
    cpb = D // 2 if bits == 16 else D * bits // 8  # code bytes per token row
    pools = (torch.empty(nw, H_kv, P, D, dtype=wdt), torch.empty(nw, H_kv, P, D, dtype=wdt),
             torch.empty(nq, H_kv, P, cpb, dtype=torch.uint8), torch.empty(nq, H_kv, P, 1, dtype=torch.float16),
             torch.empty(nq, H_kv, P, 1, dtype=torch.float16), torch.empty(nq, H_kv, P, cpb, dtype=torch.uint8),
             torch.empty(nq, H_kv, P, 1, dtype=torch.float16), torch.empty(nq, H_kv, P, 1, dtype=torch.float16))
    return AttentionArgs(
        torch.empty(N, H_q, D, dtype=wdt), torch.empty(N, H_kv, D, dtype=wdt), torch.empty(N, H_kv, D, dtype=wdt),
        torch.linspace(0, N, B + 1).round().to(torch.int32), torch.full((B,), ctx, dtype=torch.int32),
        torch.zeros(B, win_cols, dtype=torch.int32), torch.zeros(B, hist_pages, dtype=torch.int32),
        *pools, D ** -0.5, sink, recent, bits, D)


def time_step(a: AttentionArgs, layers: int, steps: int) -> tuple[float, float]:
    """(median, min) µs per layer of ``layers`` calls with the same arguments, over ``steps`` steps."""
    per_step = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        for _ in range(layers):
            ad.attention_cuda(a)
        per_step.append((time.perf_counter_ns() - t0) / 1e3 / layers)
    return statistics.median(per_step), min(per_step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _emulate_h200()
    both, fused = ("auto", "triton"), ("triton",)  # (auto would send a prefill chunk to the extend path)
    cases = [("int2 decode B=1 8k", decode_args(1, 8192, 2), both),
             ("int2 decode B=32 8k", decode_args(32, 8192, 2), both),
             ("int4 decode B=32 8k", decode_args(32, 8192, 4), both),
             ("int2 decode B=8 32k", decode_args(8, 32768, 2), both),
             ("16-bit decode B=32 8k", decode_args(32, 8192, 16), ("auto",)),
             ("int2 prefill 512 tokens B=4 8k", decode_args(4, 8192, 2, N=512), fused)]
    for name, a, envs in cases:
        for forced in envs:
            os.environ[ad.ENV] = forced
            kernel = ad.choose_attention_kernel(a.q, a.k, a.k_win, a.k_codes, a.k_scale, a.bits, a.group_size,
                                                a.cache_lens.shape[0], a.window_table, a.quant_table)[0]
            time_step(a, args.layers, 5)  # warm
            med, best = time_step(a, args.layers, args.steps)
            print(json.dumps({"case": name, "env": forced, "kernel": kernel, "us_per_layer_median": round(med, 2),
                              "us_per_layer_min": round(best, 2), "us_per_step_median": round(med * args.layers, 1)}))


if __name__ == "__main__":
    main()
