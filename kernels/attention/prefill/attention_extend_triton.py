"""``oscar::attention`` for prefill-like calls over INT-b history: dequantize once, then the paged BF16 kernel.

The fused kernel (attention_triton) decodes the history in registers in every query block: a
chunk of 2048 tokens at 64 query rows per program decodes each history tile 32 times per KV
head, and the extend step measured 1.25-1.43x the paged BF16 kernel's time (H200, Qwen3-8B
layer, 2048-30720 cached tokens). Here a sequence's cached keys and values are decoded once per
call into a transient scratch pool of full-precision pages in position order
(cache_dequant_triton: sink, history, ring), and ``attention_bf16_triton`` runs over those pages
with the chunk's own keys. The dequantization writes 2 x 16 bits per cached element, tens of µs
against milliseconds of attention.

Numerics: the reference's dequantized values s * (code - z) rounded once to the window dtype
(bitwise cache_dequant_ref), then the paged BF16 kernel's math (window-dtype dots, float32
softmax): the rounding the window tokens already get, applied to the history too.

Which calls (``extend_unsupported_reason``, from shapes and dtypes only, never tensor values, so
no host sync): more than two new tokens per sequence on average (the fused kernel's own
prefill-like rule; decode-like calls stay on the Gluon / Triton decode kernels, CUDA graphs
unchanged), INT2 or INT4 history (a 16-bit layer's history rows sit in their own pool and the
fused kernel already reads them at the paged BF16 kernel's speed: nothing to gain from a copy),
a history capacity > 0 and shapes the paged BF16 kernel takes (power-of-two D >= 32).

Which sequences, two modes:
- *per sequence* (the launch plan has no history splits: the query blocks alone fill the GPU,
  or the history is short; and the fused kernel takes the shape): only sequences with more than
  two new tokens are decoded, as many as fit a scratch of at most MAX_SCRATCH_BYTES in batch
  order (``plan_scratch``, on the device); the others, decode rows of a mixed step among them,
  run the fused kernel in a second launch that writes their rows of the same output.
- *whole call* (a split plan, whose merge writes every row): every sequence is decoded, if the
  scratch for all of them (B x the tables' columns, rounded up to 16: the most a sequence can
  address) is under the cap; else the fused kernel runs the call, as before.
"""
from __future__ import annotations

import math

import torch

from oscar_compile.kernels.attention.attention_bf16_triton import attention_bf16_triton
from oscar_compile.kernels.attention.decode.attention_triton import attention_triton, kernel_takes, plan_launch
from oscar_compile.kernels.layout.cache_dequant_ref import scratch_columns
from oscar_compile.kernels.layout.cache_dequant_triton import dequantize_cache_triton
from oscar_compile.quant import SUPPORTED_BITS

# The scratch is transient (freed when the call returns; the caching allocator hands the same
# block to the next layer) and sits in the memory the runtime leaves free beside its KV pools
# (engine_config: half of the free memory after the weights). 512 MiB takes a Qwen3-8B layer (8 KV heads,
# D 128, bf16) up to 32k cached tokens in one call (32k x 8 x 128 x 2 x 2 bytes = 128 MiB per
# sequence, so 4 such sequences, or 8 of 8k); the rest of the call runs the fused kernel.
# It also bounds the worst case of a whole-call launch, whose rows may be mostly decode rows over
# long histories: 512 MiB written and read back, about 0.25 ms per layer at 4.3 TB/s.
MAX_SCRATCH_BYTES = 512 * 2**20
EXTEND_MIN_TOKENS = 3  # a sequence with fewer new tokens (a decode row) stays on the fused kernel


def page_pair_bytes(k_win: torch.Tensor) -> int:
    """Bytes of one scratch page of keys plus one of values: 2 x [H_kv, P, D] in the window dtype."""
    return 2 * math.prod(k_win.shape[1:]) * k_win.element_size()


def scratch_bytes(num_seqs: int, window_table: torch.Tensor, quant_table: torch.Tensor,
                  k_win: torch.Tensor) -> int:
    """Bytes of a whole-call scratch: B x scratch_columns page pairs."""
    return num_seqs * scratch_columns(window_table, quant_table) * page_pair_bytes(k_win)


def per_sequence_mode(q: torch.Tensor, k: torch.Tensor, window_table: torch.Tensor,
                      quant_table: torch.Tensor, k_win: torch.Tensor, bits: int, group_size: int,
                      num_seqs: int) -> bool:
    """True when the call can be split by sequence between the two launches: neither plans
    history splits (their merge writes every output row) and the fused kernel takes the shape."""
    N, H_q, D = q.shape
    H_kv, P = k.shape[1], k_win.shape[2]
    max_hist = scratch_columns(window_table, quant_table) * P
    unsplit = plan_launch(N, num_seqs, H_kv, H_q // H_kv, max_hist, q.device)[2] == 0
    return unsplit and kernel_takes(H_q, H_kv, D, bits, group_size)


def _extend_plan(q: torch.Tensor, k: torch.Tensor, window_table: torch.Tensor, quant_table: torch.Tensor,
                 k_win: torch.Tensor, bits: int, num_seqs: int, group_size: int) -> tuple[str | None, bool]:
    """(why the call does not take the extend path or None, whether it runs per sequence)."""
    N, H_q, D = q.shape
    if bits not in SUPPORTED_BITS:
        return f"bits {bits}: a 16-bit history is read as stored by the fused kernel", False
    if N <= 2 * num_seqs:
        return "decode-like call (at most two new tokens per sequence on average)", False
    if quant_table.shape[1] == 0:
        return "no history pages: nothing to dequantize", False
    if H_q % k.shape[1] or D & (D - 1) or D < 32:
        return f"H_q {H_q}, H_kv {k.shape[1]}, D {D}: not a shape the paged BF16 kernel takes", False
    if per_sequence_mode(q, k, window_table, quant_table, k_win, bits, group_size, num_seqs):
        return None, True
    need = scratch_bytes(num_seqs, window_table, quant_table, k_win)
    if need > MAX_SCRATCH_BYTES:
        return f"whole-call scratch of {need / 2**20:.0f} MiB over the {MAX_SCRATCH_BYTES // 2**20} MiB cap", False
    return None, False


def extend_unsupported_reason(q: torch.Tensor, k: torch.Tensor, window_table: torch.Tensor,
                              quant_table: torch.Tensor, k_win: torch.Tensor, bits: int,
                              num_seqs: int, group_size: int) -> str | None:
    """Why a call does not take the extend path (None: it does). Shapes only."""
    return _extend_plan(q, k, window_table, quant_table, k_win, bits, num_seqs, group_size)[0]


def plan_scratch(cu_seqlens: torch.Tensor, cache_lens: torch.Tensor, page_size: int,
                 num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_runs [B + 1] int32, decoded [B] bool), on the device: sequences with at least
    EXTEND_MIN_TOKENS new tokens get runs of ceil(L / P) scratch pages in batch order while the
    runs fit ``num_pages`` (one that does not stays on the fused kernel, and so does every later
    one: a prefix sum, no host sync); the others get empty runs."""
    wants = (cu_seqlens[1:] - cu_seqlens[:-1]) >= EXTEND_MIN_TOKENS
    pages = torch.where(wants, (cache_lens + page_size - 1) // page_size, 0)
    decoded = wants & (pages.cumsum(0) <= num_pages)
    runs = torch.cat([pages[:1] * 0, (pages * decoded).cumsum(0)]).to(torch.int32)
    return runs, decoded


def attention_extend_triton(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win,
                            v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, sink,
                            recent, bits, group_size, history_lens=None):
    """``oscar::attention`` (same arguments) through the scratch pages. q: [N, H_q, D] ->
    [N, H_q, D] in q.dtype. Raises for a call ``extend_unsupported_reason`` refuses (the
    dispatch sends those to the fused kernel)."""
    B = cache_lens.shape[0]
    why, per_sequence = _extend_plan(q, k, window_table, quant_table, k_win, bits, B, group_size)
    if why is not None:
        raise ValueError(f"attention_extend_triton: {why}")
    pools = (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    geometry = (sink, recent, bits, group_size, history_lens)
    if not per_sequence:
        k_pages, v_pages, table = dequantize_cache_triton(cache_lens, window_table, quant_table, *pools,
                                                          *geometry)
        return attention_bf16_triton(q, k, v, cu_seqlens, cache_lens, table, k_pages, v_pages, scale)
    whole = B * scratch_columns(window_table, quant_table)
    num_pages = min(whole, MAX_SCRATCH_BYTES // page_pair_bytes(k_win))
    runs, decoded = plan_scratch(cu_seqlens, cache_lens, k_win.shape[2], num_pages)
    k_pages, v_pages, table = dequantize_cache_triton(cache_lens, window_table, quant_table, *pools,
                                                      *geometry, page_runs=runs, num_pages=num_pages)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    attention_triton(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, *pools, scale, *geometry,
                     nsplit=0, seq_mask=~decoded, out=out)
    attention_bf16_triton(q, k, v, cu_seqlens, cache_lens, table, k_pages, v_pages, scale, nsplit=0,
                          seq_mask=decoded, out=out)
    return out
