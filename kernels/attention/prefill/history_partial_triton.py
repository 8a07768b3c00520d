"""The stored history's share of decode-consistent prefill, by the Triton attention kernel's history loop.

Every row of a chunk reads the stored history [S0, S0 + h) quantized, as a decode step at its
position would: the part of a long-context prefill that grows with the context. The extend kernel
(decode/attention_triton) already runs exactly that loop at speed: codes decoded as fp16
subnormals in registers (one AND per two codes), scale and zero folded into the scores and the
softmax weights, whole 16-token blocks of the masked INT2 pages. The paged kernel's own history
loop gathered one code byte per (token, channel) and converted each: 2.1x cuDNN's BF16 prefill at
32k on an H100, where the extend kernel's prompt-exact prefill ran near cuDNN's speed.

One launch of that kernel with one history split and no window program writes, per query row,
the normalised partial over the stored history and its log2-sum-exp (the split layout of
``merge_partials``: one partial per row); the paged kernel opens its softmax with them
(decode_consistent_paged_triton, ``history="partial"``). Numerics are the extend kernel's: the
query rounded to fp16 for the history dots (as every decode step of this cache does), the value
zero-point term subtracted once, float32 accumulation, each tile's value sums joined to the
accumulators rounded to nearest (attention_blocks_triton._value_plane: one program reads the whole
history, where the MMA's truncating accumulation biased the output by percents at 128k).
"""

from __future__ import annotations

import functools

import torch
import triton

from oscar_compile.formats.cache import code_layout
from oscar_compile.kernels.attention.decode.attention_triton import (
    LOG2E,
    attn_kernel_prefill,
    dot_dtype,
    history_block_n,
    kernel_takes,
    launch_with_asm,
)
from oscar_compile.kernels.pools import FULL_PRECISION_BITS


def takes(H_q: int, H_kv: int, D: int, bits: int, group_size: int, block_n: int) -> bool:
    """Whether :func:`history_partial` runs these shapes: the extend kernel's tiles, and history
    blocks of whole 16-token blocks over masked INT2 pages."""
    return kernel_takes(H_q, H_kv, D, bits, group_size) and block_n % 16 == 0


def history_partial(q, k, v, cu_seqlens, cub, block_m: int, cache_lens, history_lens, window_table, quant_table,
                    pools: tuple, scale: float, sink: int, recent: int, bits: int, group_size: int,
                    block_n: int = 128, num_warps: int = 4, num_stages: int = 2,
                    use_asm: bool | None = None):  # fmt: skip
    """(po [N H_q, D] float32, pl [N H_q] float32): row n H_q + head's attention over its stored
    history alone, normalised, and its log2-sum-exp in the units of ``scale * log2(e)`` scores
    (-inf and zeros where the history is empty). ``cub``: query_block_prefix(cu_seqlens,
    block_m); ``pools``: the eight cache pools of the op (for a 16-bit layer the window pools
    stand in for the absent scale / zero pools). Rows past cu_seqlens[B] are not written."""
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    B = cache_lens.shape[0]
    k_win = pools[0]
    P = k_win.shape[2]
    g = H_q // H_kv
    block_n = history_block_n(bits, block_n)
    po = torch.empty(N * H_q, D, dtype=torch.float32, device=q.device)
    pl = torch.empty(N * H_q, dtype=torch.float32, device=q.device)
    launch = functools.partial(
        attn_kernel_prefill[(triton.cdiv(N, block_m) + B, H_kv, 1)],
        q, k, v, cu_seqlens, cub, cache_lens, history_lens if history_lens is not None else cache_lens,
        window_table, quant_table, *pools, po, po, pl, scale * LOG2E, B, 1, 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        window_table.stride(0), quant_table.stride(0),
        H_KV=H_kv, G_Q=g, D=D, P=P, SINK=sink, RECENT=recent, BITS=bits, GROUP=group_size,
        BLOCK_M=block_m, ROWS=max(16, triton.next_power_of_2(block_m * g)), BLOCK_N=block_n, BLOCK_W=32,
        BLOCK_C=64, SPLIT=True, WIN_SPLIT=False, DOT_DT=dot_dtype(k_win.dtype), HAS_HIST=history_lens is not None,
        SPLIT_LEN=0, MASKED=bits != FULL_PRECISION_BITS and code_layout(bits, D, P) == "masked",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    launch_with_asm(launch, use_asm, q.is_cuda)
    return po, pl
