"""Reference for decode-consistent prefill: every new token reads the cache as a decode step at its position would.

``oscar::attention`` (attention_ref) lets a chunk attend to its own tokens in full precision: the
prompt-exact semantics. Here (formats/prefill.py, ``decode-consistent``) new token t of sequence i,
at position p = L + t (L = cache_lens[i], h = the history length before the call, standard or
``history_lens[i]``), reads what ``attention_ref`` would give it as a one-token step on a cache of
p tokens written by ``cache_write_ref`` (docs/cache-format.md):

- positions ``[S0, S0 + h_p)``, ``h_p = max(h, p - W - S0)``, quantized: the history rows already
  written as stored (read back by ``quant.dequantize``), the later ones (old ring tokens, earlier
  tokens of the chunk) quantized here exactly as ``cache_write_ref`` would demote them: rounded to
  the window dtype, then ``quant.quantize`` with the layer's clip ratio and scale dtype, then
  ``quant.dequantize`` (with ``bits = 16``: the row as rounded);
- the other earlier positions (sink, and the recent window ``[S0 + h_p, p)``) at window precision:
  cached ones as stored, the chunk's rounded to the window dtype;
- its own key and value exactly as passed.

The graph runs attention before ``cache_write``, so the chunk's own old tokens are quantized here
rather than read back; the codes are those the write then stores (same input, same quantizer), and
INT-b data is only read and made through ``oscar_compile.quant`` (never its byte layout).
Scores, softmax and the weighted sum in float32, the result rounded once to q.dtype, as
attention_ref: a row equals the decode step's up to the float summation order over its keys.
"""

from __future__ import annotations

import torch

from oscar_compile import quant
from oscar_compile.kernels.attention.decode.attention_ref import (
    INVARIANT_KEY_BLOCK,
    INVARIANT_ROW_GROUP,
    gather_cached,
    sequences_with_new_tokens,
)
from oscar_compile.kernels.determinism import is_deterministic
from oscar_compile.kernels.pools import FULL_PRECISION_BITS, check_window_config, history_lens_of


def as_history(x: torch.Tensor, bits: int, group_size: int, clip: float, scale_dtype: torch.dtype) -> torch.Tensor:
    """What a history row of ``x`` ([n, H_kv, D] in the window dtype) reads back as: float32."""
    if bits == FULL_PRECISION_BITS:
        return x.float()
    packed, s, z = quant.quantize(x, bits, group_size, clip, scale_dtype)
    return quant.dequantize(packed, s, z, bits, group_size)


def decode_consistent_views(
    i: int, L: int, new: torch.Tensor, win, codes, scale, zero, tables, geometry, clip: float, kind: str
):
    """(window-precision view, history view) of positions 0..L+T-1, float32 [L + T, H_kv, D]; the
    history view is quantized from position S0 + h on (earlier history rows are stored already).
    ``kind``: "k" or "v", the byte order of the stored rows (code_layout_ref). Plain torch on the
    tensors' device."""
    sink, recent, bits, group_size, h = geometry
    cached = gather_cached(i, L, *tables, win, codes, scale, zero, sink, recent, bits, group_size, h, kind=kind)
    exact = torch.cat([cached, new.to(win.dtype).float()])
    hist = exact.clone()
    first = sink + h  # positions before it: sink (never read quantized) or stored history rows
    if exact.shape[0] > first:
        hist[first:] = as_history(exact[first:].to(win.dtype), bits, group_size, clip, scale.dtype)
    return exact, hist


def attention_decode_consistent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cache_lens: torch.Tensor,
    window_table: torch.Tensor,
    quant_table: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    scale: float,
    sink: int,
    recent: int,
    bits: int,
    group_size: int,
    clip_k: float,
    clip_v: float,
    history_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [N, H_q, D], k, v: [N, H_kv, D] new tokens -> [N, H_q, D] in q.dtype (arguments as
    ``oscar::attention``'s, plus the write's clip ratios)."""
    H_q, H_kv = q.shape[1], k.shape[1]
    if H_q % H_kv:
        raise ValueError(f"H_kv {H_kv} does not divide H_q {H_q}")
    check_window_config(sink, recent, k_win.shape[2])
    hists = history_lens_of(cache_lens, history_lens, sink, recent)
    tables = (window_table, quant_table)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, L, a, b in sequences_with_new_tokens(cu_seqlens, cache_lens):
        geometry = (sink, recent, bits, group_size, hists[i])
        k_exact, k_hist = decode_consistent_views(
            i, L, k[a:b], k_win, k_codes, k_scale, k_zero, tables, geometry, clip_k, "k"
        )
        v_exact, v_hist = decode_consistent_views(
            i, L, v[a:b], v_win, v_codes, v_scale, v_zero, tables, geometry, clip_v, "v"
        )
        attend = _attend_by_row_invariant if is_deterministic() else _attend_by_row
        out[a:b] = attend(
            q[a:b].float(),
            k[a:b].float(),
            v[a:b].float(),
            k_exact,
            k_hist,
            v_exact,
            v_hist,
            L,
            hists[i],
            sink,
            recent,
            scale,
        )
    return out.to(q.dtype)


def _attend_by_row(
    q, k_own, v_own, k_exact, k_hist, v_exact, v_hist, L: int, h: int, sink: int, recent: int, scale: float
) -> torch.Tensor:
    # q: [T, H_q, D]; k_own, v_own: [T, H_kv, D] as passed; views: [L + T, H_kv, D] -> [T, H_q, D]
    T, H_q, _ = q.shape
    g = H_q // k_exact.shape[1]
    n = L + T
    pos = torch.arange(n, device=q.device).view(1, n)
    row = L + torch.arange(T, device=q.device).view(T, 1)  # each new token's position p
    hist_end = sink + torch.clamp(row - recent - sink, min=h)  # S0 + h_p
    own = pos == row  # [T, n]
    quantized = (pos >= sink) & (pos < hist_end)
    exact = (pos < row) & ~quantized

    def scores(keys):  # [n, H_kv, D] -> [H_q, T, n]
        return torch.einsum("thd,shd->hts", q, keys.repeat_interleave(g, dim=1)) * scale

    s_own = torch.einsum("thd,thd->ht", q, k_own.repeat_interleave(g, dim=1)) * scale  # [H_q, T]
    s = torch.where(quantized, scores(k_hist), scores(k_exact))
    s = torch.where(own, s_own.unsqueeze(-1), s)
    s = s.masked_fill(~(own | quantized | exact), float("-inf"))
    p = torch.softmax(s, dim=-1)  # [H_q, T, n]
    out = torch.einsum("hts,shd->thd", p * quantized, v_hist.repeat_interleave(g, dim=1))
    out = out + torch.einsum("hts,shd->thd", p * exact, v_exact.repeat_interleave(g, dim=1))
    diag = p[:, torch.arange(T), L + torch.arange(T)]  # [H_q, T]: each row's weight on its own token
    return out + diag.transpose(0, 1).unsqueeze(-1) * v_own.repeat_interleave(g, dim=1)


def _attend_by_row_invariant(
    q, k_own, v_own, k_exact, k_hist, v_exact, v_hist, L: int, h: int, sink: int, recent: int, scale: float
) -> torch.Tensor:
    """``_attend_by_row`` with every row's bits independent of the chunk it came in (deterministic
    mode), by ``attention_ref._attend_invariant``'s rule: scores and weighted values as batches of
    ``[16, D] @ [D, 64]`` and ``[16, 64] @ [64, D]`` GEMMs over key blocks at absolute positions,
    each block summed alone, the blocks added in position order. Both views go through the same
    GEMM shapes and a row picks its view key by key; its own key's score is the diagonal of a
    ``[16, D] @ [D, 16]`` product, its weighted value added into its block elementwise."""
    T, H_q, D = q.shape
    n = L + T
    blk, R = INVARIANT_KEY_BLOCK, INVARIANT_ROW_GROUP
    nb = -(-n // blk)
    rows = -(-T // R) * R

    def padded(x: torch.Tensor, length: int) -> torch.Tensor:  # [m, H, D] -> [length, H_q, D], zeros past m
        out = torch.zeros(length, H_q, D, dtype=torch.float32, device=q.device)
        out[: x.shape[0]] = x.repeat_interleave(H_q // x.shape[1], dim=1)
        return out

    def key_blocks(x):  # [n, H_kv, D] -> [H_q nb, D, 64]
        return padded(x, nb * blk).view(nb, blk, H_q, D).permute(2, 0, 3, 1).reshape(H_q * nb, D, blk)

    def value_blocks(x):  # [n, H_kv, D] -> [H_q nb, 64, D]
        return padded(x, nb * blk).view(nb, blk, H_q, D).permute(2, 0, 1, 3).reshape(H_q * nb, blk, D)

    ke, kh, ve, vh = key_blocks(k_exact), key_blocks(k_hist), value_blocks(v_exact), value_blocks(v_hist)
    qp, ko, vo = padded(q, rows), padded(k_own, rows), padded(v_own, rows)
    key_pos = torch.arange(nb * blk, device=q.device).view(nb, 1, blk)
    out = torch.empty(rows, H_q, D, dtype=torch.float32, device=q.device)
    for r0 in range(0, rows, R):
        rq = qp[r0 : r0 + R].permute(1, 0, 2)  # [H_q, R, D]
        rqb = rq[:, None].expand(H_q, nb, R, D).reshape(H_q * nb, R, D)
        s_exact = torch.bmm(rqb, ke).view(H_q, nb, R, blk) * scale
        s_hist = torch.bmm(rqb, kh).view(H_q, nb, R, blk) * scale
        s_own = torch.bmm(rq, ko[r0 : r0 + R].permute(1, 2, 0)).diagonal(dim1=1, dim2=2) * scale  # [H_q, R]
        row_pos = (L + r0 + torch.arange(R, device=q.device)).view(1, R, 1)
        hist_end = sink + torch.clamp(row_pos - recent - sink, min=h)  # S0 + h_p
        own = key_pos == row_pos  # [nb, R, 64]
        quantized = (key_pos >= sink) & (key_pos < hist_end)
        exact = (key_pos < row_pos) & ~quantized
        s = torch.where(quantized, s_hist, s_exact)
        s = torch.where(own, s_own[:, None, :, None], s)
        s = s.masked_fill(~(own | quantized | exact), float("-inf"))
        m = s.amax(dim=(1, 3), keepdim=True)  # exact in any order
        p = torch.exp(s - m)  # [H_q, nb, R, 64]
        l_row = p.sum(-1).cumsum(1)[:, -1]  # [H_q, R]
        o = torch.bmm((p * quantized).reshape(H_q * nb, R, blk), vh).view(H_q, nb, R, D)
        o = o + torch.bmm((p * exact).reshape(H_q * nb, R, blk), ve).view(H_q, nb, R, D)
        p_own = (p * own).sum(-1)  # [H_q, nb, R]: one weight or exact zeros
        o = o + p_own[..., None] * vo[r0 : r0 + R].permute(1, 0, 2)[:, None]
        out[r0 : r0 + R] = (o.cumsum(1)[:, -1] / l_row[..., None]).permute(1, 0, 2)
    return out[:T]
