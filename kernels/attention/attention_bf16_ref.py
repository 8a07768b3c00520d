"""References for the full-precision paged cache: ``oscar::cache_write_bf16`` / ``oscar::attention_bf16``.

The runtime's BF16 mode and the paging-cost baseline: every cached token lives in full-precision
pages ``k_pages, v_pages: [N_p, H_kv, P, D]``; position p of sequence i is row p % P of page
``page_table[i, p // P]`` (page_table: [B, max_pages] int32). Same token flattening as the INT-b
ops (``cu_seqlens``, ``cache_lens`` = tokens cached before the call).

attention: new token t of sequence i attends causally to its L = cache_lens[i] cached tokens and to
the chunk's keys 0..t (as passed); GQA j -> j // g; float32 softmax; result in q.dtype.
cache_write: tokens are rounded to the pages' dtype. The write is one vectorised scatter with no
host sync (``searchsorted`` finds each token's sequence); on CUDA a Triton kernel does it in one
launch (attention_bf16_triton), bitwise the same.
"""
from __future__ import annotations

import torch

from oscar_compile.kernels.attention.decode.attention_ref import attend_over_cache


def token_positions(cu_seqlens: torch.Tensor, cache_lens: torch.Tensor, num_tokens: int):
    """(sequence, position) of each of the N flattened new tokens, both [N] int64."""
    n = torch.arange(num_tokens, device=cu_seqlens.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), n, right=True)
    pos = cache_lens.long()[seq] + n - cu_seqlens.long()[seq]
    return seq, pos


def cache_write_bf16_ref(k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages) -> None:
    """Scatter k, v: [N, H_kv, D] into the pages at positions cache_lens[i] + t. Mutates the pages."""
    P = k_pages.shape[2]
    n = min(k.shape[0], int(cu_seqlens[-1]))  # tokens past cu[-1] are not written (no cache: cu = 0)
    seq, pos = token_positions(cu_seqlens, cache_lens, n)
    page = page_table.long()[seq, pos // P]
    row = pos % P
    k_pages[page, :, row] = k[:n].to(k_pages.dtype)
    v_pages[page, :, row] = v[:n].to(v_pages.dtype)


def attention_bf16_ref(q, k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages, scale):
    """q: [N, H_q, D], k, v: [N, H_kv, D] -> [N, H_q, D] in q.dtype."""
    P = k_pages.shape[2]

    def gather(i: int, L: int):
        pos = torch.arange(L, device=q.device)
        page, row = page_table[i, pos // P].long(), pos % P
        return k_pages[page, :, row].float(), v_pages[page, :, row].float()

    return attend_over_cache(q, k, v, cu_seqlens, cache_lens, scale, gather)
