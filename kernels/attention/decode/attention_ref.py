"""Reference for ``oscar::attention`` over the mixed INT-b / full-precision paged cache (no Triton).

For sequence i with L = cache_lens[i] cached tokens and T new tokens (rows cu[i]..cu[i+1] of q, k, v),
new token t (position L + t) attends to keys 0..L+t:
- cached positions p < L, read from the pools: p < S0 from window slot p (sink); S0 <= p < S0 + h
  dequantized from history row p - S0 (``oscar_compile.quant.dequantize``: s * (code - z) with
  s, z read from the scale dtype as float32; with bits = 16 the row as stored); S0 + h <= p from
  ring slot S0 + (p - S0) % W.
  h = ``history_lens[i]`` when given (larger than standard right after a prefix-cache hit: the
  ring then holds fewer than W tokens), else the standard max(0, L - W - S0);
- the chunk's own keys 0..t in full precision, exactly as passed (not rounded to the window dtype).
GQA: query head j reads KV head j // (H_q / H_kv). Scores q . k * scale, softmax and the weighted
sum of values in float32; the result is rounded once to q.dtype. Queries arrive already rotated
(q R_K), keys rotated and centred, so q . k' = q . k - q . mu: the softmax is unchanged.
Call it before ``cache_write`` of the same tokens (the chunk is not yet in the pools).
"""
from __future__ import annotations

import torch

from oscar_compile import quant
from oscar_compile.kernels.determinism import is_deterministic
from oscar_compile.kernels.layout.code_layout_ref import read_code_rows
from oscar_compile.kernels.pools import (
    FULL_PRECISION_BITS,
    check_window_config,
    history_lens_of,
    index_runs,
    window_slot,
)


def gather_cached(
    i: int, L: int, window_table: torch.Tensor, quant_table: torch.Tensor,
    win: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    sink: int, recent: int, bits: int, group_size: int, history_len: int | None = None, *, kind: str,
) -> torch.Tensor:
    """Dense float32 [L, H_kv, D] view of one sequence's cached keys (or values), positions 0..L-1.

    history_len: h, the positions [S0, S0 + h) read from the history; None: the standard
    max(0, L - W - S0). kind: "k" or "v", the pools' byte order (``code_layout_ref``).
    """
    h = max(0, L - recent - sink) if history_len is None else history_len
    out = torch.empty(L, win.shape[1], win.shape[3], dtype=torch.float32, device=win.device)
    gather_cached_into(out, [(i, L, h, 0)], window_table, quant_table, win, codes, scale, zero, sink, recent, bits,
                       group_size, kind=kind)  # fmt: skip
    return out


def gather_cached_into(
    out: torch.Tensor, seqs: list[tuple[int, int, int, int]], window_table: torch.Tensor, quant_table: torch.Tensor,
    win: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    sink: int, recent: int, bits: int, group_size: int, *, kind: str,
) -> None:
    """``gather_cached`` of several sequences at once: for each (i, L, h, row) of ``seqs``,
    ``out[row : row + L]`` gets sequence i's cached positions 0..L-1 with h history tokens, by one
    gather per precision (the index runs are built on the host: no sync per sequence)."""
    P, dev = win.shape[2], win.device
    window, history = [], []  # runs (sequence, first position, count, row of position 0)
    for i, L, h, row in seqs:
        h = min(h, max(L - sink, 0))
        window += [(i, 0, min(L, sink), row), (i, sink + h, L - sink - h, row)]
        history.append((i, sink, h, row))
    seq, pos, dst = _run_indices(window, dev)
    slot = window_slot(pos, sink, recent)
    out[dst] = win[window_table[seq, slot // P].long(), :, slot % P].float()
    seq, pos, dst = _run_indices(history, dev)
    if dst.numel():
        page, r = quant_table[seq, (pos - sink) // P].long(), (pos - sink) % P
        if bits == FULL_PRECISION_BITS:
            out[dst] = codes[page, :, r].float()
        else:
            out[dst] = quant.dequantize_groups(read_code_rows(codes, page, r, kind, bits), scale[page, :, r],
                                               zero[page, :, r], group_size)  # fmt: skip


def _run_indices(runs: list[tuple[int, int, int, int]], device) -> tuple[torch.Tensor, ...]:
    """(sequence, position, row of ``out``) of every element of the non-empty runs."""
    runs = [run for run in runs if run[2] > 0]
    ids, firsts, counts, rows = ([run[k] for run in runs] for k in range(4))
    n = torch.tensor(counts, dtype=torch.int64)
    pos = index_runs(firsts, counts)
    seq, base = (torch.repeat_interleave(torch.tensor(x, dtype=torch.int64), n) for x in (ids, rows))
    return seq.to(device), pos.to(device), (pos + base).to(device)


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    # q: [T, H_q, D] f32; keys, vals: [L + T, H_kv, D] f32 -> [T, H_q, D] f32
    T, H_q, _ = q.shape
    g = H_q // keys.shape[1]
    kk = keys.repeat_interleave(g, dim=1)  # [L+T, H_q, D]
    vv = vals.repeat_interleave(g, dim=1)
    s = torch.einsum("thd,shd->hts", q, kk) * scale  # [H_q, T, L+T]
    t = torch.arange(T, device=q.device).view(T, 1)
    allowed = torch.arange(L + T, device=q.device).view(1, L + T) <= L + t  # [T, L+T]
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hts,shd->thd", p, vv)


# deterministic mode: keys in blocks of this many positions from position 0, queries in groups of
# this many rows (the last group zero-padded): every product below has one shape per model
INVARIANT_KEY_BLOCK = 64
INVARIANT_ROW_GROUP = 16


def _attend_invariant(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    """``_attend`` with every row's bits independent of the chunk it came in (deterministic mode).

    ``_attend``'s einsums and softmax reduce in an order that depends on T and L: a prompt
    prefilled in chunks, or a decode step, gives other last bits than one prefill. Here each
    product is a batch of ``[16, D] @ [D, 64]`` (scores) or ``[16, 64] @ [64, D]`` (values) GEMMs,
    whatever T and L (16 query rows, zero-padded; block b of 64 keys holds positions
    ``[64 b, 64 b + 64)``, wherever they came from: pools or chunk); each block's 64 weights are
    summed alone, and the blocks are added one after another in position order (``cumsum`` is a
    sequential scan): blocks past a row's position add exact zeros. The max over the visible keys
    is exact, hence the same in every chunking.
    q: [T, H_q, D] f32; keys, vals: [L + T, H_kv, D] f32 -> [T, H_q, D] f32."""
    T, H_q, D = q.shape
    S = keys.shape[0]
    g = H_q // keys.shape[1]
    blk, R = INVARIANT_KEY_BLOCK, INVARIANT_ROW_GROUP
    nb = -(-S // blk)
    kk = torch.zeros(nb * blk, H_q, D, dtype=torch.float32, device=keys.device)
    vv = torch.zeros_like(kk)
    kk[:S] = keys.repeat_interleave(g, dim=1)
    vv[:S] = vals.repeat_interleave(g, dim=1)
    k_blocks = kk.view(nb, blk, H_q, D).permute(2, 0, 3, 1).reshape(H_q * nb, D, blk)  # [H_q nb, D, 64]
    v_blocks = vv.view(nb, blk, H_q, D).permute(2, 0, 1, 3).reshape(H_q * nb, blk, D)  # [H_q nb, 64, D]
    key_pos = torch.arange(nb * blk, device=q.device).view(nb, blk)
    rows = -(-T // R) * R
    qp = torch.zeros(rows, H_q, D, dtype=torch.float32, device=q.device)
    qp[:T] = q
    out = torch.empty(rows, H_q, D, dtype=torch.float32, device=q.device)
    for r0 in range(0, rows, R):
        rq = qp[r0:r0 + R].permute(1, 0, 2)  # [H_q, R, D]
        rq = rq[:, None].expand(H_q, nb, R, D).reshape(H_q * nb, R, D)
        s = torch.bmm(rq, k_blocks).view(H_q, nb, R, blk) * scale
        row_pos = L + r0 + torch.arange(R, device=q.device)
        visible = key_pos[:, None, :] <= row_pos[None, :, None]  # [nb, R, 64]
        s = s.masked_fill(~visible, float("-inf"))
        m = s.amax(dim=(1, 3), keepdim=True)  # [H_q, 1, R, 1]: exact; a padding row sees key 0
        p = torch.exp(s - m)  # [H_q, nb, R, 64]
        l_row = p.sum(-1).cumsum(1)[:, -1]  # [H_q, R]
        o = torch.bmm(p.reshape(H_q * nb, R, blk), v_blocks).view(H_q, nb, R, D)
        o_row = o.cumsum(1)[:, -1]  # [H_q, R, D]
        out[r0:r0 + R] = (o_row / l_row[..., None]).permute(1, 0, 2)
    return out[:T]


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
    cache_lens: torch.Tensor, window_table: torch.Tensor, quant_table: torch.Tensor,
    k_win: torch.Tensor, v_win: torch.Tensor,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    scale: float, sink: int, recent: int, bits: int, group_size: int,
    history_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [N, H_q, D], k, v: [N, H_kv, D] new tokens -> [N, H_q, D] in q.dtype.

    history_lens: [B] int32 history length h per sequence, or None (standard).
    """
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    if H_q % H_kv:
        raise ValueError(f"H_kv {H_kv} does not divide H_q {H_q}")
    check_window_config(sink, recent, k_win.shape[2])
    common = (window_table, quant_table)
    hists = history_lens_of(cache_lens, history_lens, sink, recent)

    def gather(i: int, L: int):
        geometry = (sink, recent, bits, group_size, hists[i])
        kc = gather_cached(i, L, *common, k_win, k_codes, k_scale, k_zero, *geometry, kind="k")
        vc = gather_cached(i, L, *common, v_win, v_codes, v_scale, v_zero, *geometry, kind="v")
        return kc, vc

    return attend_over_cache(q, k, v, cu_seqlens, cache_lens, scale, gather)


def sequences_with_new_tokens(cu_seqlens, cache_lens):
    """(i, cached length L, first row a, end row b) of each sequence with new tokens, read on the
    host (the references' loop)."""
    cu = cu_seqlens.tolist()
    for i, L in enumerate(cache_lens.tolist()):
        if cu[i] < cu[i + 1]:
            yield i, L, cu[i], cu[i + 1]


def attend_over_cache(q, k, v, cu_seqlens, cache_lens, scale: float, gather) -> torch.Tensor:
    """Each sequence's new tokens attend to ``gather(i, L)`` (its cached keys and values, float32
    [L, H_kv, D]) plus their own chunk, causally. q: [N, H_q, D] -> [N, H_q, D] in q.dtype."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, L, a, b in sequences_with_new_tokens(cu_seqlens, cache_lens):
        kc, vc = gather(i, L)
        keys = torch.cat([kc, k[a:b].float()], dim=0)
        vals = torch.cat([vc, v[a:b].float()], dim=0)
        attend = _attend_invariant if is_deterministic() else _attend
        out[a:b] = attend(q[a:b].float(), keys, vals, L, scale)
    return out.to(q.dtype)
