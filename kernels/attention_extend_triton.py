"""``oscar::attention`` for prefill-like calls over INT-b history: dequantize once, then the paged BF16 kernel.

The fused kernel (attention_triton) decodes the history in registers in every query block: a
chunk of 2048 tokens at 64 query rows per program decodes each history tile 32 times per KV
head, and the extend step measured 1.25-1.43x the paged BF16 kernel's time (H200, Qwen3-8B
layer, 2048-30720 cached tokens). Here each sequence's cached keys and values are decoded once
per call into a transient scratch pool of full-precision pages in position order
(cache_dequant_triton: sink, history, ring), and ``attention_bf16_triton`` runs over those pages
with the chunk's own keys. The dequantization writes 2 x 16 bits per cached element, tens of µs
against milliseconds of attention.

Numerics: the reference's dequantized values s * (code - z) rounded once to the window dtype
(bitwise cache_dequant_ref), then the paged BF16 kernel's math (window-dtype dots, float32
softmax): the rounding the window tokens already get, applied to the history too.

Which calls take it (``extend_unsupported_reason``, from shapes and dtypes only, never tensor
values, so no host sync): more than two new tokens per sequence on average (the fused kernel's
own prefill-like rule; decode-like calls stay on the Gluon / Triton decode kernels, CUDA graphs
unchanged), INT2 or INT4 history (a 16-bit layer's history rows sit in their own pool and the
fused kernel already reads them at the paged BF16 kernel's speed: nothing to gain from a copy),
a history capacity > 0, shapes the paged BF16 kernel takes (power-of-two D >= 32), and a
scratch of at most MAX_SCRATCH_BYTES. The scratch is sized from the tables' widths: B sequences
x (window + quant table columns, rounded up to 16) pages, the most a sequence can address.
Everything else runs the fused kernel, as before. The call decodes every sequence of the batch,
decode rows mixed into a prefill step included: for those it is extra work (write and read back
32 bits per cached element against reading 2.25), which the cap bounds. (Sending only the long
chunks here would need the split of rows between two launches decided on the device, merges
included; not done.)
"""
from __future__ import annotations

import math

import torch

from oscar_compile.kernels.attention_bf16_triton import attention_bf16_triton
from oscar_compile.kernels.cache_dequant_ref import scratch_columns
from oscar_compile.kernels.cache_dequant_triton import dequantize_cache_triton
from oscar_compile.quant import SUPPORTED_BITS

# The scratch is transient (freed when the call returns; the caching allocator hands the same
# block to the next layer) and sits in the memory the runtime leaves free beside its KV pools
# (loader: half of the free memory after the weights). 512 MiB takes a Qwen3-8B layer (8 KV heads,
# D 128, bf16) up to 32k cached tokens in one call (32k x 8 x 128 x 2 x 2 bytes = 128 MiB per
# sequence, so 4 such sequences, or 8 of 8k); bigger calls are still correct on the fused kernel.
# It also bounds the worst case, a prefill step whose rows are nearly all decode rows over long
# histories: 512 MiB written and read back, about 0.25 ms per layer at 4.3 TB/s.
MAX_SCRATCH_BYTES = 512 * 2**20


def scratch_bytes(num_seqs: int, window_table: torch.Tensor, quant_table: torch.Tensor,
                  k_win: torch.Tensor) -> int:
    """Bytes of the K and V scratch pages of one call: B x scratch_columns pages of [H_kv, P, D]."""
    page_bytes = math.prod(k_win.shape[1:]) * k_win.element_size()
    return 2 * num_seqs * scratch_columns(window_table, quant_table) * page_bytes


def extend_unsupported_reason(q: torch.Tensor, k: torch.Tensor, window_table: torch.Tensor,
                              quant_table: torch.Tensor, k_win: torch.Tensor, bits: int,
                              num_seqs: int) -> str | None:
    """Why a call does not take the dequantize-then-BF16 path (None: it does). Shapes only."""
    N, H_q, D = q.shape
    if bits not in SUPPORTED_BITS:
        return f"bits {bits}: a 16-bit history is read as stored by the fused kernel"
    if N <= 2 * num_seqs:
        return "decode-like call (at most two new tokens per sequence on average)"
    if quant_table.shape[1] == 0:
        return "no history pages: nothing to dequantize"
    if H_q % k.shape[1] or D & (D - 1) or D < 32:
        return f"H_q {H_q}, H_kv {k.shape[1]}, D {D}: not a shape the paged BF16 kernel takes"
    need = scratch_bytes(num_seqs, window_table, quant_table, k_win)
    if need > MAX_SCRATCH_BYTES:
        return f"scratch of {need / 2**20:.0f} MiB over the {MAX_SCRATCH_BYTES // 2**20} MiB cap"
    return None


def attention_extend_triton(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win,
                            v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, sink,
                            recent, bits, group_size, history_lens=None):
    """``oscar::attention`` (same arguments) through the scratch pages. q: [N, H_q, D] ->
    [N, H_q, D] in q.dtype. Raises for a call ``extend_unsupported_reason`` refuses (the
    dispatch sends those to the fused kernel)."""
    why = extend_unsupported_reason(q, k, window_table, quant_table, k_win, bits, cache_lens.shape[0])
    if why is not None:
        raise ValueError(f"attention_extend_triton: {why}")
    k_pages, v_pages, table = dequantize_cache_triton(
        cache_lens, window_table, quant_table, k_win, v_win, k_codes, k_scale, k_zero, v_codes,
        v_scale, v_zero, sink, recent, bits, group_size, history_lens)
    return attention_bf16_triton(q, k, v, cu_seqlens, cache_lens, table, k_pages, v_pages, scale)
