"""Reference for ``oscar::cache_write``: place new tokens in the paged cache, plain torch (no Triton).

Semantics are those of writing the tokens of each sequence one position at a time
(docs/cache-format.md); the bulk form below reaches the identical state:
- writing position L (cache grows to L + 1) stores the token in window slot L when L < S0, else in
  recent-window slot S0 + (L - S0) % W; if the window then holds more than W recent tokens, the
  oldest, p = L - W (only when p >= S0), is demoted: quantized into history row h = p - S0, i.e.
  page quant_table[i, h // P], row h % P. W = 0: every p >= S0 goes straight to the history.
- the ring holds positions [S0 + h, L), h = the history length before the call: ``history_lens[i]``
  when given, else the standard max(0, L - W - S0). A larger h is the state after a prefix-cache
  hit (shared history [S0, S0 + h), a ring not yet full): the ring slots of positions below
  S0 + h hold no token, and nothing is demoted from them (their history rows are already
  written, and may be shared with other sequences).
- bulk, T tokens at positions [L, L + T): (1) first demote the old ring tokens that leave,
  positions [S0 + h, min(L, L + T - W)), read from the ring *before* any new token reuses
  their slot (p and p + W share a slot); (2) new tokens with p < S0 go to the sink, with
  p >= L + T - W to the ring, the rest straight to history (rows p - S0 >= h).

Details that are easy to get wrong:
- a token is rounded to the window dtype *before* it is quantized, also when it goes straight to
  history: one-at-a-time writing would have stored it in the window first, so bulk == one-by-one
  bitwise only with this rounding.
- ``bits = 16`` (a layer kept at 16 bits beside INT-b layers): a demoted token is copied into its
  history row as it is, no clip, no scale / zero (pools.FULL_PRECISION_BITS).
- keys and values are quantized independently: keys with ``clip_k``, values with ``clip_v``;
  the scale dtype is the pools' (``k_scale.dtype``), and codes use the scale/zero already rounded
  to it (``oscar_compile.quant.quantize`` does this).
- the codes go into the pools in the layer's byte order (``code_layout_ref.write_code_rows``):
  in a masked INT2 page a key byte holds 4 tokens, so a write sets its own bit pairs and keeps
  the others (a page need not be zeroed when it is taken; the Triton write clears and sets its
  bit pairs the same way).
- ``cache_lens`` is not advanced here: the caller does it after the write.
"""
from __future__ import annotations

import torch

from oscar_compile import quant
from oscar_compile.kernels.layout.code_layout_ref import write_code_rows
from oscar_compile.kernels.pools import FULL_PRECISION_BITS, check_window_config, history_lens_of, window_slot


def check_cache_write_args(k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win,
                           k_codes, k_scale, sink, recent, bits, group_size, history_lens=None) -> None:
    N, H, D = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if k_win.dim() != 4 or k_win.shape[1] != H or k_win.shape[3] != D:
        raise ValueError(f"k_win {tuple(k_win.shape)} does not match k [N, {H}, {D}]")
    P = k_win.shape[2]
    check_window_config(sink, recent, P)
    if bits == FULL_PRECISION_BITS:
        if k_codes.shape[1:] != (H, P, D) or k_codes.dtype != k_win.dtype:
            raise ValueError(f"16-bit history rows {tuple(k_codes.shape)} {k_codes.dtype} are not "
                             f"[N_q, {H}, {P}, {D}] {k_win.dtype}")
    else:
        if k_codes.shape[1:] != (H, P, D * bits // 8):
            raise ValueError(f"k_codes {tuple(k_codes.shape)} is not [N_q, {H}, {P}, {D * bits // 8}]")
        if D % group_size or k_scale.shape[1:] != (H, P, D // group_size):
            raise ValueError(f"k_scale {tuple(k_scale.shape)} does not match group_size {group_size}")
    B = cache_lens.shape[0]
    if cu_seqlens.shape != (B + 1,):
        raise ValueError(f"cu_seqlens must be [B + 1] = [{B + 1}], got {tuple(cu_seqlens.shape)}")
    if window_table.shape[0] != B or quant_table.shape[0] != B:
        raise ValueError("window_table and quant_table need one row per sequence")
    if window_table.shape[1] * P < sink + recent:
        raise ValueError(f"window_table has {window_table.shape[1]} pages, needs {(sink + recent) // P}")
    if history_lens is not None and history_lens.shape != (B,):
        raise ValueError(f"history_lens must be [B] = [{B}], got {tuple(history_lens.shape)}")


def _locate_history(pos: torch.Tensor, quant_row: torch.Tensor, sink: int, P: int):
    h = pos - sink
    return quant_row[h // P].long(), h % P


def _locate_window(pos: torch.Tensor, window_row: torch.Tensor, sink: int, recent: int, P: int):
    slot = window_slot(pos, sink, recent)
    return window_row[slot // P].long(), slot % P


def _store_history(xk, xv, pages, rows, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                   bits, group_size, clip_k, clip_v) -> None:
    # xk, xv: [n, H_kv, D] already in the window dtype
    if bits == FULL_PRECISION_BITS:  # a 16-bit layer: the rows as they are, no clip
        k_codes[pages, :, rows] = xk
        v_codes[pages, :, rows] = xv
        return
    for kind, x, clip, codes, scale, zero in (("k", xk, clip_k, k_codes, k_scale, k_zero),
                                              ("v", xv, clip_v, v_codes, v_scale, v_zero)):
        c, s, z = quant.quantize_groups(quant.clip_per_token(x, clip), bits, group_size, scale.dtype)
        write_code_rows(codes, pages, rows, c, kind, bits)
        scale[pages, :, rows] = s
        zero[pages, :, rows] = z


def cache_write_ref(
    k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cache_lens: torch.Tensor,
    window_table: torch.Tensor, quant_table: torch.Tensor,
    k_win: torch.Tensor, v_win: torch.Tensor,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    sink: int, recent: int, bits: int, group_size: int, clip_k: float, clip_v: float,
    history_lens: torch.Tensor | None = None,
) -> None:
    """Write k, v: [N, H_kv, D] (N = all new tokens, sequence after sequence) into the pools in place.

    history_lens: [B] int32 history length h per sequence before the call, or None (standard).
    """
    check_cache_write_args(k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win,
                           k_codes, k_scale, sink, recent, bits, group_size, history_lens)
    P = k_win.shape[2]
    wdt = k_win.dtype
    qpools = (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    cu = cu_seqlens.tolist()
    lens = cache_lens.tolist()
    hists = history_lens_of(cache_lens, history_lens, sink, recent)
    dev = k_win.device
    for i, (L, h) in enumerate(zip(lens, hists, strict=True)):
        T = cu[i + 1] - cu[i]
        if T == 0:
            continue
        L_new = L + T
        # (1) old ring tokens that age out, read before their slots are reused
        lo, hi = sink + h, min(L, L_new - recent)
        if hi > lo:
            old = torch.arange(lo, hi, device=dev)
            wp, wr = _locate_window(old, window_table[i], sink, recent, P)
            xk, xv = k_win[wp, :, wr], v_win[wp, :, wr]  # [n, H_kv, D]
            hp, hr = _locate_history(old, quant_table[i], sink, P)
            _store_history(xk, xv, hp, hr, *qpools, bits, group_size, clip_k, clip_v)
        # (2) the new tokens
        pos = torch.arange(L, L_new, device=dev)
        kn = k[cu[i]:cu[i + 1]].to(device=dev, dtype=wdt)  # [T, H_kv, D]
        vn = v[cu[i]:cu[i + 1]].to(device=dev, dtype=wdt)
        in_window = (pos < sink) | (pos >= L_new - recent)
        to_hist = ~in_window
        if in_window.any():
            wp, wr = _locate_window(pos[in_window], window_table[i], sink, recent, P)
            k_win[wp, :, wr] = kn[in_window]
            v_win[wp, :, wr] = vn[in_window]
        if to_hist.any():
            hp, hr = _locate_history(pos[to_hist], quant_table[i], sink, P)
            _store_history(kn[to_hist], vn[to_hist], hp, hr, *qpools, bits, group_size, clip_k, clip_v)
