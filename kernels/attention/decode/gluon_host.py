"""The host side both Gluon decode wrappers share (``attention_gluon``: fp16 operands;
``attention_gluon_int8``: 8-bit integer dots), written once.

Both kernels take the same arguments in the same order (the query, the chunk's keys and values,
the tables, the pools, the partials, then the scalars and strides), launch one program per (token,
head group, split), write normalised partials with their log2-sum-exp and leave the merge to
``merge_partials``. So the start of a call (shapes, the refusal, the output, the empty batch), the
plan's fill-in, the partial buffers, the launch's arguments and the offline sm_90 compile's
signature are the same code for both; what differs (the checks, the plan, the code pools' views,
the constexprs) stays in each wrapper.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from oscar_compile.kernels.pools import attention_output_for


class DecodeShapes(NamedTuple):
    """N tokens of B sequences, H_q query heads over H_kv KV heads (g = H_q / H_kv), head_dim D,
    pages of P tokens."""

    N: int
    B: int
    H_q: int
    H_kv: int
    g: int
    D: int
    P: int


def decode_call_problem(q, k_win, N: int, B: int) -> str | None:
    """Why neither Gluon decode kernel takes a call of these dtypes and token counts (None: this
    part of the checks passes)."""
    if k_win.dtype not in (torch.bfloat16, torch.float16) or q.dtype not in (torch.bfloat16, torch.float16):
        return f"window dtype {k_win.dtype} / query dtype {q.dtype} (16-bit only)"
    if N > 2 * B:
        return "a prefill-like batch (more than 2 tokens per sequence)"
    return None


def begin_decode(kernel: str, unsupported: Callable[[int, int], str | None], q, k, v, cache_lens, k_win,
                 pools: tuple, history_lens) -> tuple[DecodeShapes, torch.Tensor]:
    """The call's shapes and its output ``[N, H_q, D]`` (zeros where no row is computed); raises
    with ``unsupported(N, B)``'s reason when the kernel does not take the call. ``pools``: the
    eight pools in ``oscar::attention``'s order."""
    N, H_q, D = q.shape
    B, H_kv = cache_lens.shape[0], k.shape[1]
    why = unsupported(N, B)
    if why is not None:
        raise ValueError(f"the {kernel} does not take this call: {why}")
    out = attention_output_for(q, k, v, pools, history_lens, B)
    return DecodeShapes(N, B, H_q, H_kv, H_q // H_kv, D, k_win.shape[2]), out


def fill_plan(nsplit: int | None, win_splits: int | None, plan: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    """(nsplit, nwin): what the caller passed (the dispatch's plan of its step, a benchmark's
    sweep), the rest from ``plan()``."""
    if nsplit is None or win_splits is None:
        planned = plan()
        nsplit = planned[0] if nsplit is None else nsplit
        win_splits = planned[1] if win_splits is None else win_splits
    return nsplit, win_splits


def split_partials(s: DecodeShapes, num_partials: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split's normalised partial ``[N * H_q * num_partials, D]`` and its log2-sum-exp, float32."""
    rows = s.N * s.H_q * num_partials
    return (torch.empty(rows, s.D, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def decode_launch_args(q, k, v, cu_seqlens, cache_lens, history_lens, window_table, quant_table, k_win, v_win,
                       code_pools: tuple, po, pl, qk_scale: float, nsplit: int, nwin: int) -> tuple:
    """The kernels' positional arguments, in their shared order (``code_pools``: the six code,
    scale and zero pools as each kernel views them)."""
    return (q, k, v, cu_seqlens, cache_lens, history_lens if history_lens is not None else cache_lens,
            window_table, quant_table, k_win, v_win, *code_pools, po, pl, qk_scale, cache_lens.shape[0],
            nsplit, nwin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            window_table.stride(0), quant_table.stride(0))


def compile_decode_offline(kernel, window_dtype: str, code_pool_types: tuple[str, ...], consts: dict,
                           maxnreg: int):
    """Compile a decode kernel for sm_90 without a GPU (CI, and the benchmarks' instruction counts).

    ``code_pool_types``: the six code / scale / zero pools' element types as the kernel reads them.
    Returns Triton's compiled kernel: ``.asm`` holds "ttgir", "ptx", "cubin" (and "sass" where
    Triton finds its disassembler), ``.metadata.shared`` the shared memory in bytes."""
    from triton.backends.compiler import GPUTarget

    from oscar_compile.kernels.gluon_compat import gluon_ast_source

    pools = dict(zip(("kc_ptr", "ks_ptr", "kz_ptr", "vc_ptr", "vs_ptr", "vz_ptr"), code_pool_types, strict=True))
    ptrs = {"q_ptr": window_dtype, "k_ptr": window_dtype, "v_ptr": window_dtype, "cu_ptr": "i32",
            "lens_ptr": "i32", "hist_ptr": "i32", "wt_ptr": "i32", "qt_ptr": "i32",
            "kwin_ptr": window_dtype, "vwin_ptr": window_dtype, **pools, "po_ptr": "fp32", "pl_ptr": "fp32"}
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig.update({"qk_scale": "fp32", **{n: "i32" for n in (
        "B", "nsplit", "nwin", "sqn", "sqh", "skn", "skh", "svn", "svh", "stride_wt", "stride_qt")}})
    sig.update({name: "constexpr" for name in consts})
    # as the JIT specializes: pointers and the strides (multiples of 16 in practice) divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(len(ptrs)), *range(len(ptrs) + 4, len(ptrs) + 12))}
    src = gluon_ast_source()(kernel, sig, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
