"""Decode-consistent prefill on the paged cache as stored: the portable (plain Triton) path.

Semantics: attention_decode_consistent_ref (each new token at position p reads the sink and its
recent window at window precision, everything older quantized, its own key and value as passed).
The path before (a kernel over packed views, deleted) built 16-bit copies of every sequence's
whole history per call and layer; here the history stays in its INT-b pages:

    [0, min(S0, L))              sink, cached: window pages, exact, every row
    [S0, S0 + h)                 stored history: INT-b pages, quantized, every row
    [band_lo, L + T)             the band (band_triton: ring tokens and the chunk, <= W + T
                                 positions), both versions from the pre-pass buffers

and the band splits as the query block's positions [p_lo, p_hi] put it (hist_end(p) =
S0 + max(h, p - W - S0), non-decreasing in p):

    [band_lo, min(max(band_lo, S0), p_hi))   a first chunk's own sink tokens: exact, causal
    [max(band_lo, S0), hist_end(p_lo))       quantized for every row
    [hist_end(p_lo), hist_end(p_hi))         chosen per row (fewer than BLOCK_M keys)
    [hist_end(p_hi), p_hi)                   recent window and chunk: exact, causal

The own key opens each row's softmax (max = its score, sum 1, accumulator = its value), so masked
keys add exact zeros. One program per (BLOCK_M tokens of one sequence, KV head) holds the g query
heads of that head (ROWS = BLOCK_M g rows). The grid is ``cdiv(N, BLOCK_M) + B`` programs and a
device-side block prefix maps each to its sequence: the plan comes from shapes, no host sync.

Deterministic mode (``ALIGNED``): one loop over key blocks at absolute positions, every block
through both versions, each row choosing key by key. A position reads the same operand from a
page or from the band (band_triton's docstring), so a row's bits do not depend on the chunking.

Numerics: dots in the window / q dtype with float32
accumulation on the GPU (float32 and IEEE in the interpreter), dequantized history rounded once
to the operand dtype, softmax in float32 base 2, the output rounded once to q.dtype; the folded
loop's value sums (codes, non-negative) join the accumulator per tile, rounded to nearest
(attention_blocks_triton._value_plane says why). With one
group per row (group_size = head_dim, Qwen3-8B's layers) the stored-history loop folds scale and
zero out of the tiles (``_attend_folded``): the dots take the codes themselves (exact in bf16),
which cut the 32k row from 54.6 to 31.9 ms on an H100 (bench/results/2026-12-05-h100-...). Not in
deterministic mode, whose tiles must equal the band's dequantized operands.

Status: the runtime's chunk path (cache/decode_consistent.py). With 16-bit queries the stored
history runs in a launch of its own (history_partial_triton, the extend kernel's loop) and this
kernel opens its softmax with that partial (HIST = 2): 0.68x / 1.46x / 1.41x cuDNN at 8k / 32k /
128k on an H100, against 2.22x / 2.32x at 32k / 128k with the folded loop in this kernel (HIST = 1,
which gathers and converts one code byte per (token, channel);
bench/results/2026-12-05-gpu-int2-prefill-end-to-end, call 15). A Hopper path (wgmma fed from
registers, issue 32's probes) is not written yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.formats.cache import code_layout
from oscar_compile.kernels.attention.attention_blocks_triton import seq_of_program
from oscar_compile.kernels.attention.decode.attention_triton import LOG2E, dot_dtype, query_block_prefix
from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import attention_decode_consistent_ref
from oscar_compile.kernels.attention.prefill.band_triton import band_cu, write_band
from oscar_compile.kernels.attention.prefill.history_partial_triton import history_partial, takes
from oscar_compile.kernels.attention.prefill.paged_tiles_triton import (
    band_tile,
    code_tile,
    code_values,
    history_rows,
    history_tile,
    window_tile,
)
from oscar_compile.kernels.determinism import is_deterministic
from oscar_compile.kernels.pools import FULL_PRECISION_BITS, check_window_config


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _attend(q, m, den, acc, kt, vt, key_ok, qk_scale, IEEE: tl.constexpr):
    """Fold one key tile kt, vt [BN, D] (key_ok [ROWS, BN] or [1, BN]) into the softmax state."""
    s = tl.where(key_ok, _dot(q, tl.trans(kt), None, IEEE) * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    return m_new, den, _dot(p.to(vt.dtype), vt, acc * alpha[:, None], IEEE)


@triton.jit
def _attend_two(q, m, den, acc, kh, vh, ke, ve, quantized, exact, qk_scale, IEEE: tl.constexpr):
    """One key tile in both versions, row r reading kh / vh where quantized, ke / ve where exact."""
    s_h = _dot(q, tl.trans(kh), None, IEEE) * qk_scale
    s_e = _dot(q, tl.trans(ke), None, IEEE) * qk_scale
    s = tl.where(quantized, s_h, tl.where(exact, s_e, float("-inf")))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    acc = _dot(tl.where(quantized, p, 0.0).to(vh.dtype), vh, acc * alpha[:, None], IEEE)
    return m_new, den, _dot(tl.where(exact, p, 0.0).to(ve.dtype), ve, acc, IEEE)


@triton.jit
def _attend_folded(q, qsum, m, den, acc, zacc, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, qt_row, pos, ok, h,
                   qk_scale, SINK: tl.constexpr, H_KV: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                   BITS: tl.constexpr, MASKED: tl.constexpr, DOT_DT: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
    """A stored-history tile with one group per row (GROUP == D), scale and zero folded out of
    the tiles: the dots take the codes (exact), score = s (q . c) - s z sum(q), and the values'
    zero term sum_n p'_n z_n, p' = p s rounded to the dots' dtype, goes to ``zacc`` (subtracted
    once after the loop)."""
    hidx, rows = history_rows(qt_row, pos, ok, h, SINK, H_KV, P)
    sk = tl.load(ks_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    zk = tl.load(kz_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    kt = code_values(code_tile(kc_ptr, hidx, rows, ok, D, BITS, MASKED, True), BITS, DOT_DT)
    raw = _dot(q, tl.trans(kt), None, IEEE)
    s = (raw * sk[None, :] - (sk * zk)[None, :] * qsum[:, None]) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    sv = tl.load(vs_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    zv = tl.load(vz_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    pv = (p * sv[None, :]).to(DOT_DT)
    zacc = zacc * alpha + tl.sum(pv.to(tl.float32) * zv[None, :], axis=1)
    vt = code_values(code_tile(vc_ptr, hidx, rows, ok, D, BITS, MASKED, False), BITS, DOT_DT)
    tile = _dot(pv, vt, None, IEEE)  # from zero, joined to acc rounded to nearest (_value_plane's docstring)
    return m_new, den, tl.fma(acc, tl.broadcast_to(alpha[:, None], tile.shape), tile), zacc


@triton.jit
def _paged_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, cub_ptr, bcu_ptr, lens_ptr, hist_ptr, wt_ptr, qt_ptr,
    kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, ke_ptr, kh_ptr, ve_ptr, vh_ptr,
    po_ptr, pl_ptr, B, qk_scale, sqn, sqh, skn, skh, svn, svh, stride_wt, stride_qt,
    H_KV: tl.constexpr, G_Q: tl.constexpr, D: tl.constexpr, P: tl.constexpr, SINK: tl.constexpr,
    RECENT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, MASKED: tl.constexpr,
    HAS_HIST: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DT: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr, HIST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    h = tl.program_id(1)
    if pid >= tl.load(cub_ptr + B):
        return
    i = seq_of_program(cub_ptr, pid, B)
    start = tl.load(cu_ptr + i)
    T = tl.load(cu_ptr + i + 1) - start
    L = tl.load(lens_ptr + i)
    t0 = (pid - tl.load(cub_ptr + i)) * BLOCK_M
    if HAS_HIST:
        n_hist = tl.load(hist_ptr + i)
    else:
        n_hist = tl.maximum(L - RECENT - SINK, 0)
    r = tl.arange(0, ROWS)
    tok = t0 + r // G_Q
    head = h * G_Q + r % G_Q
    row_ok = (r < BLOCK_M * G_Q) & (tok < T)
    p = L + tok
    hist_end = SINK + tl.maximum(n_hist, p - RECENT - SINK)
    d = tl.arange(0, D)[None, :]
    n = (start + tok).to(tl.int64)[:, None]
    qf = tl.load(q_ptr + n * sqn + head[:, None] * sqh + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    k_own = tl.load(k_ptr + n * skn + h * skh + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    m = tl.sum(qf * k_own, axis=1) * qk_scale  # the own key opens the softmax
    den = tl.zeros([ROWS], tl.float32) + 1.0
    acc = tl.load(v_ptr + n * svn + h * svh + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if HIST == 2:  # the stored history's partial (history_partial_triton) joins the own key
        prow = (start + tok).to(tl.int64) * (H_KV * G_Q) + head
        lse = tl.load(pl_ptr + prow, mask=row_ok, other=float("-inf"))
        m_new = tl.maximum(m, lse)
        a_own = tl.math.exp2(m - m_new)
        a_hist = tl.math.exp2(lse - m_new)
        hist_o = tl.load(po_ptr + prow[:, None] * D + d, mask=row_ok[:, None], other=0.0)
        acc = acc * a_own[:, None] + hist_o * a_hist[:, None]
        den = a_own + a_hist
        m = m_new
    q = qf.to(DOT_DT)
    p_hi = L + tl.minimum(t0 + BLOCK_M, T) - 1
    sink_end = tl.minimum(SINK, L)  # cached sink tokens
    band_lo = tl.minimum(L, SINK + n_hist)
    hist_top = SINK + tl.where(L >= SINK, n_hist, 0)  # end of the stored history
    row0 = tl.load(bcu_ptr + i) - (L - RECENT)  # band row of position 0
    wt_row = wt_ptr + i.to(tl.int64) * stride_wt
    qt_row = qt_ptr + i.to(tl.int64) * stride_qt
    if ALIGNED:  # deterministic mode: key blocks at absolute positions, both versions, every row
        for n0 in range(0, p_hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            col_ok = pos < p_hi
            in_sink = pos < sink_end
            in_pages = (pos >= SINK) & (pos < hist_top)
            in_band = col_ok & (pos >= band_lo)
            ke = tl.where(in_sink[:, None], window_tile(kwin_ptr, wt_row, pos, in_sink, h, H_KV, P, D, DOT_DT),
                          band_tile(ke_ptr, row0, pos, in_band, h, H_KV, D))  # fmt: skip
            ve = tl.where(in_sink[:, None], window_tile(vwin_ptr, wt_row, pos, in_sink, h, H_KV, P, D, DOT_DT),
                          band_tile(ve_ptr, row0, pos, in_band, h, H_KV, D))  # fmt: skip
            band_h = in_band & (pos >= SINK)
            kh = tl.where(in_pages[:, None], history_tile(kc_ptr, ks_ptr, kz_ptr, qt_row, pos, in_pages, h, SINK,
                                                          H_KV, P, D, BITS, GROUP, MASKED, True, DOT_DT),
                          band_tile(kh_ptr, row0, pos, band_h, h, H_KV, D))  # fmt: skip
            vh = tl.where(in_pages[:, None], history_tile(vc_ptr, vs_ptr, vz_ptr, qt_row, pos, in_pages, h, SINK,
                                                          H_KV, P, D, BITS, GROUP, MASKED, False, DOT_DT),
                          band_tile(vh_ptr, row0, pos, band_h, h, H_KV, D))  # fmt: skip
            quantized = col_ok[None, :] & (pos[None, :] >= SINK) & (pos[None, :] < hist_end[:, None])
            exact = col_ok[None, :] & ~quantized & (pos[None, :] < p[:, None])
            m, den, acc = _attend_two(q, m, den, acc, kh, vh, ke, ve, quantized, exact, qk_scale, IEEE)
    else:
        for n0 in range(0, sink_end, BLOCK_N):  # cached sink
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < sink_end
            kt = window_tile(kwin_ptr, wt_row, pos, ok, h, H_KV, P, D, DOT_DT)
            vt = window_tile(vwin_ptr, wt_row, pos, ok, h, H_KV, P, D, DOT_DT)
            m, den, acc = _attend(q, m, den, acc, kt, vt, ok[None, :], qk_scale, IEEE)
        if HIST == 1:  # stored history, straight from the pages, scale and zero folded out
            qsum = tl.sum(q.to(tl.float32), axis=1)
            zacc = tl.zeros([ROWS], tl.float32)
            for n0 in range(SINK, hist_top, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                m, den, acc, zacc = _attend_folded(q, qsum, m, den, acc, zacc, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr,
                                                   vz_ptr, qt_row, pos, pos < hist_top, h, qk_scale, SINK, H_KV, P,
                                                   D, BITS, MASKED, DOT_DT, IEEE)  # fmt: skip
            acc -= zacc[:, None]
        elif HIST == 0:
            for n0 in range(SINK, hist_top, BLOCK_N):  # stored history, dequantized tiles
                pos = n0 + tl.arange(0, BLOCK_N)
                ok = pos < hist_top
                kt = history_tile(kc_ptr, ks_ptr, kz_ptr, qt_row, pos, ok, h, SINK, H_KV, P, D, BITS, GROUP, MASKED,
                                  True, DOT_DT)  # fmt: skip
                vt = history_tile(vc_ptr, vs_ptr, vz_ptr, qt_row, pos, ok, h, SINK, H_KV, P, D, BITS, GROUP, MASKED,
                                  False, DOT_DT)  # fmt: skip
                m, den, acc = _attend(q, m, den, acc, kt, vt, ok[None, :], qk_scale, IEEE)
        hs = tl.maximum(band_lo, SINK)
        own_sink_end = tl.minimum(hs, p_hi)
        for n0 in range(band_lo, own_sink_end, BLOCK_N):  # a first chunk's own sink tokens
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < own_sink_end
            kt = band_tile(ke_ptr, row0, pos, ok, h, H_KV, D)
            vt = band_tile(ve_ptr, row0, pos, ok, h, H_KV, D)
            m, den, acc = _attend(q, m, den, acc, kt, vt, ok[None, :] & (pos[None, :] < p[:, None]), qk_scale, IEEE)
        hist_lo = SINK + tl.maximum(n_hist, L + t0 - RECENT - SINK)
        hist_hi = tl.maximum(hist_lo, SINK + tl.maximum(n_hist, p_hi - RECENT - SINK))
        for n0 in range(hs, hist_lo, BLOCK_N):  # quantized for every row
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < hist_lo
            kt = band_tile(kh_ptr, row0, pos, ok, h, H_KV, D)
            vt = band_tile(vh_ptr, row0, pos, ok, h, H_KV, D)
            m, den, acc = _attend(q, m, den, acc, kt, vt, ok[None, :], qk_scale, IEEE)
        for n0 in range(hist_lo, hist_hi, BLOCK_N):  # the boundary: chosen per row
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < hist_hi
            kh = band_tile(kh_ptr, row0, pos, ok, h, H_KV, D)
            vh = band_tile(vh_ptr, row0, pos, ok, h, H_KV, D)
            ke = band_tile(ke_ptr, row0, pos, ok, h, H_KV, D)
            ve = band_tile(ve_ptr, row0, pos, ok, h, H_KV, D)
            quantized = ok[None, :] & (pos[None, :] < hist_end[:, None])
            exact = ok[None, :] & ~quantized & (pos[None, :] < p[:, None])
            m, den, acc = _attend_two(q, m, den, acc, kh, vh, ke, ve, quantized, exact, qk_scale, IEEE)
        for n0 in range(hist_hi, p_hi, BLOCK_N):  # recent window and chunk
            pos = n0 + tl.arange(0, BLOCK_N)
            ok = pos < p_hi
            kt = band_tile(ke_ptr, row0, pos, ok, h, H_KV, D)
            vt = band_tile(ve_ptr, row0, pos, ok, h, H_KV, D)
            m, den, acc = _attend(q, m, den, acc, kt, vt, ok[None, :] & (pos[None, :] < p[:, None]), qk_scale, IEEE)
    out = acc / den[:, None]
    tl.store(out_ptr + n * (H_KV * G_Q * D) + head[:, None] * D + d, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])  # fmt: skip


def _memo(memo: dict | None, key: tuple, make):
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


HISTORY_MODES = {"tiles": 0, "folded": 1, "partial": 2}  # the kernel's HIST


def _history_mode(history: str | None, aligned: bool, q_dtype: torch.dtype, H_q: int, H_kv: int, D: int, bits: int,
                  group_size: int, history_block_n: int) -> str:  # fmt: skip
    """The stored-history path a call runs (see the wrapper's ``history``)."""
    if aligned:
        return "tiles"
    takes_partial = takes(H_q, H_kv, D, bits, group_size, history_block_n)
    if history is None:
        history = "partial" if q_dtype != torch.float32 and takes_partial else "folded"
    if history == "partial" and not takes_partial:
        raise ValueError(f"history='partial' cannot take head_dim {D}, {bits} bits, group {group_size}, "
                         f"history_block_n {history_block_n}")  # fmt: skip
    if history == "folded" and (group_size != D or bits == FULL_PRECISION_BITS):
        history = "tiles"
    return history


def _torch_dtype(dt) -> torch.dtype:
    return {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}[dt]


def attention_decode_consistent_paged_triton(
    q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win, k_codes, k_scale, k_zero,
    v_codes, v_scale, v_zero, scale, sink, recent, bits, group_size, clip_k, clip_v, history_lens=None,
    block_rows: int = 128, block_n: int = 32, num_warps: int = 4, num_stages: int = 2, history: str | None = None,
    history_rows: int = 64, history_block_n: int = 128, history_warps: int = 4, step_memo: dict | None = None,
    history_asm: bool | None = None,
):  # fmt: skip
    """The reference's call (same arguments): the band pre-pass, the stored history's partial
    (``history`` "partial"), then the kernel; no host sync (``history_lens`` None: the standard h,
    computed on the device). q: [N, H_q, D], k, v: [N, H_kv, D] -> [N, H_q, D] in q.dtype (rows
    past cu_seqlens[B]: zero). A head_dim the tiles cannot take (not a power of two >= 16) runs
    the reference.

    ``history``, how the stored history is read (deterministic mode ignores it: its aligned
    blocks must equal the band's dequantized operands): "partial", by the extend kernel's history
    loop in a launch of its own (history_partial_triton; ``history_rows`` query rows and
    ``history_block_n`` keys per program, ``history_warps`` warps), the default for 16-bit
    queries; "folded", scale and zero folded out of the tiles in this kernel, the dots on the
    codes (one group per row only, else "tiles"), the default for float32 queries (exact dots);
    "tiles", dequantized tiles in this kernel. The default tiles of this kernel are the fastest of
    bench.prefill_paged's sweep at 32k on an H100 (128 rows, 32 keys, 4 warps: 27.3 ms against 59.0
    at 64 / 64, bench/results/2026-12-05-h100-decode-consistent-prefill-kernel).
    ``step_memo``: a dict that lives for one step of a runner (every layer passes the same
    ``cu_seqlens`` object, alive for the step): the band and query-block offsets, a dozen small
    launches, are made by the first layer and read by the others. ``history_asm``: the partial's
    code decode (``launch_with_asm``; None: inline PTX on a GPU), for checks of its numerics."""
    if history is not None and history not in HISTORY_MODES:
        raise ValueError(f"history must be one of {sorted(HISTORY_MODES)} or None, got {history!r}")
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    if H_q % H_kv:
        raise ValueError(f"H_kv {H_kv} does not divide H_q {H_q}")
    check_window_config(sink, recent, k_win.shape[2])
    pools = (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    if D & (D - 1) or D < 16:
        call = (q, k, v, cu_seqlens, cache_lens, window_table, quant_table, *pools, scale, sink, recent, bits)
        return attention_decode_consistent_ref(*call, group_size, clip_k, clip_v, history_lens)
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dim")
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    B = cache_lens.shape[0]
    if N == 0 or B == 0:
        return out
    g = H_q // H_kv
    block_m = max(1, block_rows // g)
    dot_dt = dot_dtype(q.dtype)
    bcu = _memo(step_memo, ("band_cu", id(cu_seqlens), recent), lambda: band_cu(cu_seqlens, recent))
    full = bits == FULL_PRECISION_BITS
    band = write_band(k, v, cu_seqlens, bcu, cache_lens, history_lens, window_table, k_win, v_win,
                      k_win.dtype if full else k_scale.dtype, sink, recent, bits, group_size, clip_k, clip_v,
                      _torch_dtype(dot_dt))  # fmt: skip
    if full:  # no scale / zero pools: stand-ins, never read
        pools = (k_win, v_win, k_codes, k_win, k_win, v_codes, v_win, v_win)
    cub = _memo(step_memo, ("query_blocks", id(cu_seqlens), block_m), lambda: query_block_prefix(cu_seqlens, block_m))
    aligned = is_deterministic()
    mode = _history_mode(history, aligned, q.dtype, H_q, H_kv, D, bits, group_size, history_block_n)
    partial = (out, out)  # stand-ins, never read
    if mode == "partial":
        hist_m = max(1, history_rows // g)
        hub = _memo(step_memo, ("query_blocks", id(cu_seqlens), hist_m), lambda: query_block_prefix(cu_seqlens, hist_m))
        partial = history_partial(q, k, v, cu_seqlens, hub, hist_m, cache_lens, history_lens, window_table,
                                  quant_table, pools, scale, sink, recent, bits, group_size, history_block_n,
                                  history_warps, use_asm=history_asm)  # fmt: skip
    grid = (triton.cdiv(N, block_m) + B, H_kv)
    _paged_kernel[grid](
        q, k, v, out, cu_seqlens, cub, bcu, cache_lens, history_lens if history_lens is not None else cache_lens,
        window_table, quant_table, *pools, *band, *partial, B, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        window_table.stride(0), quant_table.stride(0),
        H_KV=H_kv, G_Q=g, D=D, P=k_win.shape[2], SINK=sink, RECENT=recent, BITS=bits, GROUP=group_size,
        MASKED=code_layout(bits, D, k_win.shape[2]) == "masked", HAS_HIST=history_lens is not None,
        BLOCK_M=block_m, ROWS=max(16, triton.next_power_of_2(block_m * g)), BLOCK_N=block_n, DOT_DT=dot_dt,
        IEEE=dot_dt == tl.float32, ALIGNED=aligned,
        HIST=HISTORY_MODES[mode], num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def compile_offline(block_rows: int = 128, block_n: int = 32, num_warps: int = 4, num_stages: int = 2,
                    aligned: bool = False, history: str = "partial", bits: int = 2):  # fmt: skip
    """Compile the kernel for sm_90 without a GPU (Qwen3-8B's layer: bf16, 32 / 8 heads, head_dim
    128, group 128, S0 64, W 256, pages of 16; INT2 masked). Returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", out_ptr="bf16", cu_ptr="i32", cub_ptr="i32",
                bcu_ptr="i32", lens_ptr="i32", hist_ptr="i32", wt_ptr="i32", qt_ptr="i32", kwin_ptr="bf16",
                vwin_ptr="bf16", kc_ptr="u8", ks_ptr="fp16", kz_ptr="fp16", vc_ptr="u8", vs_ptr="fp16",
                vz_ptr="fp16", ke_ptr="bf16", kh_ptr="bf16", ve_ptr="bf16", vh_ptr="bf16", po_ptr="fp32",
                pl_ptr="fp32")  # fmt: skip
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig.update(B="i32", qk_scale="fp32")
    sig.update({n: "i32" for n in ("sqn", "sqh", "skn", "skh", "svn", "svh", "stride_wt", "stride_qt")})
    block_m = max(1, block_rows // 4)
    consts = dict(H_KV=8, G_Q=4, D=128, P=16, SINK=64, RECENT=256, BITS=bits, GROUP=128,
                  MASKED=code_layout(bits, 128, 16) == "masked", HAS_HIST=False, BLOCK_M=block_m,
                  ROWS=max(16, triton.next_power_of_2(block_m * 4)), BLOCK_N=block_n, DOT_DT=tl.bfloat16,
                  IEEE=False, ALIGNED=aligned, HIST=0 if aligned else HISTORY_MODES[history])  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}
    src = ASTSource(_paged_kernel, sig, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})
