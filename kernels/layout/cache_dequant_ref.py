"""Reference for the extend path's dequantization: each sequence's cache as dense pages in position order.

A prefill-like ``oscar::attention`` call over INT-b history (attention_extend_triton) decodes
its sequences' cached keys and values once into a transient scratch pool of full-precision
pages and runs the paged BF16 kernel over it. This module says what those pages hold, in plain
torch (no Triton), in the standard layout (the Triton kernel can also place each sequence's run
of pages elsewhere, ``page_runs``: the same rows at other page numbers):

- scratch pages ``k_pages, v_pages: [B * C, H_kv, P, D]`` in the window dtype, C = the columns of
  ``window_table`` plus those of ``quant_table`` (a sequence holds at most S0 + W + h tokens, and
  h at most ``quant_table.shape[1] * P``), rounded up to a multiple of 16 (``scratch_columns``);
- ``page_table: [B, C]`` int32, sequence i's pages ``i * C .. i * C + C - 1`` in order;
- position p < L of sequence i sits at row p % P of page ``page_table[i, p // P]``: the value
  ``attention_ref.gather_cached`` gives it (sink and ring slots as stored, history rows
  dequantized as ``quant.dequantize`` does: s * (code - z) in float32), rounded once to the window
  dtype (round to nearest even). Rows of positions >= L are zero here and left unwritten by the
  kernel (the attention masks them).
"""
from __future__ import annotations

import torch

from oscar_compile.kernels.attention.decode.attention_ref import gather_cached
from oscar_compile.kernels.pools import check_window_config, history_lens_of


def scratch_columns(window_table: torch.Tensor, quant_table: torch.Tensor) -> int:
    """Scratch pages per sequence: every page the tables can address, rounded up to a multiple of
    16. The paged BF16 kernel specializes on its page table's row stride (a multiple of 16 or
    not) and so does the dequantization's output: one compiled variant for every table width
    (the runner compiles it at startup, not in the middle of a batch), for at most 15 pages of
    address space more per sequence (never written or read)."""
    return -(-(window_table.shape[1] + quant_table.shape[1]) // 16) * 16


def scratch_page_table(B: int, cols: int, device) -> torch.Tensor:
    """[B, cols] int32: sequence i owns scratch pages i * cols .. (i + 1) * cols - 1."""
    return torch.arange(B * cols, dtype=torch.int32, device=device).view(B, cols)


def dequantize_cache_ref(cache_lens, window_table, quant_table, k_win, v_win, k_codes, k_scale,
                         k_zero, v_codes, v_scale, v_zero, sink, recent, bits, group_size,
                         history_lens=None):
    """(k_pages, v_pages, page_table) as the module doc says; cache_lens: [B] int32."""
    B, P = cache_lens.shape[0], k_win.shape[2]
    H, D = k_win.shape[1], k_win.shape[3]
    check_window_config(sink, recent, P)
    cols = scratch_columns(window_table, quant_table)
    hists = history_lens_of(cache_lens, history_lens, sink, recent)
    k_pages = torch.zeros(B * cols, H, P, D, dtype=k_win.dtype, device=k_win.device)
    v_pages = torch.zeros_like(k_pages)
    table = scratch_page_table(B, cols, k_win.device)
    for i, L in enumerate(cache_lens.tolist()):
        if L > cols * P:
            raise ValueError(f"sequence {i}: {L} cached tokens, the tables hold at most {cols * P}")
        geometry = (sink, recent, bits, group_size, hists[i])
        for kind, win, codes, scale, zero, pages in (("k", k_win, k_codes, k_scale, k_zero, k_pages),
                                                     ("v", v_win, v_codes, v_scale, v_zero, v_pages)):
            dense = gather_cached(i, L, window_table, quant_table, win, codes, scale, zero, *geometry, kind=kind)
            pos = torch.arange(L, device=k_win.device)
            pages[table[i, pos // P].long(), :, pos % P] = dense.to(k_win.dtype)
    return k_pages, v_pages, table
