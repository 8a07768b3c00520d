"""Triton decode-consistent prefill: each new token reads the cache as a decode step at its position would.

The reference (attention_decode_consistent_ref) scores a chunk against a dense [H_q, T, L + T]
matrix: at a 32k prompt, 32k x 32k scores per query head. Here the same two views of a
sequence's keys and values (``decode_consistent_views``, plain torch on the tensors' device:
positions 0..L+T-1 at window precision, and a copy with positions [S0 + h, L + T) quantized and
dequantized as ``cache_write`` demotes them; [L + T, H_kv, D] each, O(context) memory, stored
in the dots' operand dtype) are read by a flash-attention kernel: one program per (BLOCK_M new
tokens of one sequence, KV head) holds the g query heads of that KV head (ROWS = BLOCK_M g rows;
row r: token t0 + r // g), with an online softmax in float32 over key blocks. No T x L matrix is
ever built.

The row of position p = L + t reads key s < p from the history view when
S0 <= s < hist_end(p) = S0 + max(h, p - W - S0), from the exact view otherwise, and its own key
and value (s = p) as passed: the reference's rule. hist_end is non-decreasing in p, and
hist_end(p) <= p wherever [S0, hist_end(p)) is not empty, so the keys [0, p_hi) of a query block
of positions [p_lo, p_hi] fall into four runs, each loop reading one view except the third:

    [0, min(S0, p_hi))                 sink: exact view, causal mask (a first chunk's rows may sit in it)
    [S0, hist_end(p_lo))               history for every row: history view, no mask
    [hist_end(p_lo), hist_end(p_hi))   boundary (fewer than BLOCK_M keys): both views, chosen per row
    [hist_end(p_hi), p_hi)             recent window and chunk: exact view, causal mask

The runs begin where the query block's positions put them, so a row's key blocks follow its
chunk. In deterministic mode (``ALIGNED``) one loop reads key blocks at absolute positions
instead, each through both views, each row choosing key by key: a row's bits are then the same
in any chunk.

The own key starts each row's softmax (max = its score, sum 1, accumulator = its value), so every
row has a finite score from the start and masked keys add exact zeros.

Numerics: with float32 q the dots are IEEE float32 (the reference up to the float summation order
over a row's keys); with bf16 / fp16 q they take q's dtype on the GPU, with float32 accumulation:
the views are stored in it (half the memory and traffic of float32; window values are exact in
the window dtype, dequantized history values are rounded once, as the extend path rounds them to
the window dtype). The interpreter computes every dot, and keeps the views, in float32
(``attention_triton.dot_dtype``). The own score is a float32 product sum. The output is rounded
once to q.dtype.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import triton
import triton.language as tl

from oscar_compile.kernels.attention.decode.attention_ref import gather_cached_into
from oscar_compile.kernels.attention.decode.attention_triton import LOG2E, dot_dtype
from oscar_compile.kernels.attention.prefill.attention_decode_consistent_ref import (
    as_history,
    attention_decode_consistent_ref,
)
from oscar_compile.kernels.determinism import is_deterministic
from oscar_compile.kernels.pools import check_window_config, history_lens_of, index_runs


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """a @ b (+ acc), float32 result; IEEE: exact float32 products (no TF32)."""
    if IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _view_rows(view, pos, ok, ROW_STRIDE: tl.constexpr, D: tl.constexpr, DOT_DT: tl.constexpr):
    """[BLOCK_N, D] rows of a view (``view`` points at position 0 of the program's KV head) at
    positions ``pos``, zeros where not ``ok``, in the dots' dtype."""
    d = tl.arange(0, D)[None, :]
    rows = tl.load(view + pos.to(tl.int64)[:, None] * ROW_STRIDE + d, mask=ok[:, None], other=0.0)
    return rows.to(DOT_DT)


@triton.jit
def _softmax_step(m, den, acc, s):
    """Fold the scores s [ROWS, BLOCK_N] (log2 domain, -inf where masked) into the running max m,
    denominator den and accumulator acc; -> (m, den, acc rescaled, the block's weights p)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    return m_new, den * alpha + tl.sum(p, axis=1), acc * alpha[:, None], p


@triton.jit
def _one_view(
    q,
    m,
    den,
    acc,
    k_view,
    v_view,
    pos,
    key_ok,
    col_ok,
    qk_scale,
    ROW_STRIDE: tl.constexpr,
    D: tl.constexpr,
    DOT_DT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Attend to the keys at ``pos`` of one view; key_ok [ROWS, BLOCK_N] (or [1, BLOCK_N])."""
    kt = _view_rows(k_view, pos, col_ok, ROW_STRIDE, D, DOT_DT)
    s = tl.where(key_ok, _dot(q, tl.trans(kt), None, IEEE) * qk_scale, float("-inf"))
    m, den, acc, p = _softmax_step(m, den, acc, s)
    vt = _view_rows(v_view, pos, col_ok, ROW_STRIDE, D, DOT_DT)
    return m, den, _dot(p.to(DOT_DT), vt, acc, IEEE)


@triton.jit
def _two_views(
    q,
    m,
    den,
    acc,
    kh_view,
    vh_view,
    ke_view,
    ve_view,
    pos,
    quantized,
    exact,
    col_ok,
    qk_scale,
    ROW_STRIDE: tl.constexpr,
    D: tl.constexpr,
    DOT_DT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Attend to the keys at ``pos``, each row reading the history view where ``quantized`` and
    the exact view where ``exact`` ([ROWS, BLOCK_N], disjoint; neither: masked)."""
    s_hist = _dot(q, tl.trans(_view_rows(kh_view, pos, col_ok, ROW_STRIDE, D, DOT_DT)), None, IEEE)
    s_exact = _dot(q, tl.trans(_view_rows(ke_view, pos, col_ok, ROW_STRIDE, D, DOT_DT)), None, IEEE)
    s = tl.where(quantized, s_hist * qk_scale, tl.where(exact, s_exact * qk_scale, float("-inf")))
    m, den, acc, p = _softmax_step(m, den, acc, s)
    acc = _dot(
        tl.where(quantized, p, 0.0).to(DOT_DT), _view_rows(vh_view, pos, col_ok, ROW_STRIDE, D, DOT_DT), acc, IEEE
    )
    acc = _dot(tl.where(exact, p, 0.0).to(DOT_DT), _view_rows(ve_view, pos, col_ok, ROW_STRIDE, D, DOT_DT), acc, IEEE)
    return m, den, acc


@triton.jit
def _four_runs(
    q, m, den, acc, kh, vh, ke, ve, p, hist_end, p_hi, hist_lo, hist_hi, qk_scale,
    ROW_STRIDE: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DT: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """The keys [0, p_hi) of a query block in the four runs of the module docstring, each run
    reading one view except the boundary."""
    sink_end = tl.minimum(SINK, p_hi)
    for n0 in range(0, sink_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        col_ok = pos < sink_end
        key_ok = col_ok[None, :] & (pos[None, :] < p[:, None])
        m, den, acc = _one_view(q, m, den, acc, ke, ve, pos, key_ok, col_ok, qk_scale, ROW_STRIDE, D, DOT_DT, IEEE)
    for n0 in range(SINK, hist_lo, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        col_ok = pos < hist_lo
        m, den, acc = _one_view(
            q, m, den, acc, kh, vh, pos, col_ok[None, :], col_ok, qk_scale, ROW_STRIDE, D, DOT_DT, IEEE
        )
    for n0 in range(hist_lo, hist_hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        col_ok = pos < hist_hi
        quantized = col_ok[None, :] & (pos[None, :] < hist_end[:, None])
        exact = col_ok[None, :] & (pos[None, :] >= hist_end[:, None]) & (pos[None, :] < p[:, None])
        m, den, acc = _two_views(
            q, m, den, acc, kh, vh, ke, ve, pos, quantized, exact, col_ok, qk_scale, ROW_STRIDE, D, DOT_DT, IEEE
        )
    for n0 in range(hist_hi, p_hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        col_ok = pos < p_hi
        key_ok = col_ok[None, :] & (pos[None, :] < p[:, None])
        m, den, acc = _one_view(q, m, den, acc, ke, ve, pos, key_ok, col_ok, qk_scale, ROW_STRIDE, D, DOT_DT, IEEE)
    return m, den, acc


@triton.jit
def _decode_consistent_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, lens_ptr, hist_ptr, vstart_ptr, bseq_ptr, bt0_ptr,
    ke_ptr, kh_ptr, ve_ptr, vh_ptr, qk_scale, sqn, sqh, skn, skh, svn, svh,
    H_KV: tl.constexpr, G_Q: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DT: tl.constexpr,
    IEEE: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    ROW_STRIDE: tl.constexpr = H_KV * D
    blk = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.load(bseq_ptr + blk)  # the block's sequence and first new token
    t0 = tl.load(bt0_ptr + blk)
    start = tl.load(cu_ptr + i)
    T = tl.load(cu_ptr + i + 1) - start
    L = tl.load(lens_ptr + i)
    n_hist = tl.load(hist_ptr + i)
    r = tl.arange(0, ROWS)
    tok = t0 + r // G_Q
    head = h * G_Q + r % G_Q
    row_ok = (r < BLOCK_M * G_Q) & (tok < T)
    p = L + tok  # [ROWS] each row's position
    hist_end = SINK + tl.maximum(n_hist, p - RECENT - SINK)
    d = tl.arange(0, D)[None, :]
    n = (start + tok).to(tl.int64)[:, None]
    qf = tl.load(q_ptr + n * sqn + head[:, None] * sqh + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    k_own = tl.load(k_ptr + n * skn + h * skh + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    m = tl.sum(qf * k_own, axis=1) * qk_scale  # the own key opens the softmax
    den = tl.zeros([ROWS], tl.float32) + 1.0
    acc = tl.load(v_ptr + n * svn + h * svh + d, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = qf.to(DOT_DT)
    p_lo = L + t0
    p_hi = L + tl.minimum(t0 + BLOCK_M, T) - 1
    hist_lo = SINK + tl.maximum(n_hist, p_lo - RECENT - SINK)
    hist_hi = SINK + tl.maximum(n_hist, p_hi - RECENT - SINK)
    base = (tl.load(vstart_ptr + i).to(tl.int64) * H_KV + h) * D  # position 0 of this sequence and KV head
    ke, kh, ve, vh = ke_ptr + base, kh_ptr + base, ve_ptr + base, vh_ptr + base
    if ALIGNED:  # deterministic mode: key blocks at absolute positions, both views, every row
        for n0 in range(0, p_hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            col_ok = pos < p_hi
            quantized = col_ok[None, :] & (pos[None, :] >= SINK) & (pos[None, :] < hist_end[:, None])
            exact = col_ok[None, :] & ~quantized & (pos[None, :] < p[:, None])
            m, den, acc = _two_views(
                q, m, den, acc, kh, vh, ke, ve, pos, quantized, exact, col_ok, qk_scale, ROW_STRIDE, D, DOT_DT, IEEE
            )
    else:
        m, den, acc = _four_runs(
            q, m, den, acc, kh, vh, ke, ve, p, hist_end, p_hi, hist_lo, hist_hi, qk_scale,
            ROW_STRIDE, D, SINK, BLOCK_N, DOT_DT, IEEE,
        )  # fmt: skip
    out = acc / den[:, None]
    tl.store(
        out_ptr + n * (H_KV * G_Q * D) + head[:, None] * D + d, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None]
    )


def packed_views(k, v, cu, lens, hists, tables, pools, sink, recent, bits, group_size, clip_k, clip_v, dtype):
    """The four views of every sequence with new tokens, packed position-major: (k_exact, k_hist,
    v_exact, v_hist) [sum (L_i + T_i), H_kv, D] in ``dtype`` (the reference's float32 values,
    rounded once), and each sequence's first row ([B] int32; 0 for a sequence without new tokens,
    whose views are not built).

    Built for the whole call at once, not per sequence: the new tokens land by one scatter and the
    rows read quantized but not stored yet (ring and chunk tokens past S0 + h) go through one
    ``as_history`` call, and the cached positions of every sequence by one gather per precision
    (``gather_cached_into``). The quantizer works row by row (per token and head), so the values
    are the reference's, bitwise. Built per sequence, a batch of 32 prompts of 512 tokens (two
    chunks each: one ends at the snapshot boundary of its last page) took 8.7 s to first token at
    8B, bench/results/2026-12-03-h200-deterministic-gpu-ttft-decode-capacity."""
    k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero = pools
    counts = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    sizes = [L + n if n else 0 for L, n in zip(lens, counts, strict=True)]
    starts = list(accumulate(sizes[:-1], initial=0))
    # quantized here: positions [S0 + h, L + T) of each sequence with new tokens
    firsts = [sink + h for h in hists]
    quantized = [max(0, size - first) if size else 0 for size, first in zip(sizes, firsts, strict=True)]
    new_rows = index_runs([s + L for s, L in zip(starts, lens, strict=True)], counts).to(k.device)
    hist_rows = index_runs([s + f for s, f in zip(starts, firsts, strict=True)], quantized).to(k.device)
    cached = [(i, L, hists[i], starts[i]) for i, L in enumerate(lens) if L and counts[i]]
    views = []
    for new, win, codes, scale, zero, clip, kind in ((k, k_win, k_codes, k_scale, k_zero, clip_k, "k"),
                                                     (v, v_win, v_codes, v_scale, v_zero, clip_v, "v")):
        exact = torch.empty(sum(sizes), *new.shape[1:], dtype=torch.float32, device=new.device)
        gather_cached_into(exact, cached, *tables, win, codes, scale, zero, sink, recent, bits, group_size, kind=kind)
        exact[new_rows] = new[: cu[-1]].to(win.dtype).float()
        hist = exact.clone()
        hist[hist_rows] = as_history(exact[hist_rows].to(win.dtype), bits, group_size, clip, scale.dtype)
        views += [exact.to(dtype), hist.to(dtype)]
    return views, torch.tensor(starts, dtype=torch.int32, device=k.device)


def attention_decode_consistent_triton(
    q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win, k_codes, k_scale, k_zero,
    v_codes, v_scale, v_zero, scale, sink, recent, bits, group_size, clip_k, clip_v, history_lens=None,
    block_rows: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
):  # fmt: skip
    """The reference's call (same arguments) through the views and the kernel. q: [N, H_q, D],
    k, v: [N, H_kv, D] -> [N, H_q, D] in q.dtype (rows past cu_seqlens[B]: zero, as the reference).

    ``block_rows``: query rows per program (BLOCK_M = block_rows // g tokens times g heads).
    ``num_stages`` 2: with Triton's default of 3 the pipelined float32 view tiles of a float32
    call at head_dim 128 take 304 KiB of shared memory (compile_offline), over the 227 KiB an
    sm_90 block may use (bf16: 208 KiB with 3 stages, 144 KiB with 2; which is faster is not
    measured). Reads ``cu_seqlens``, ``cache_lens`` and ``history_lens`` on the host (the views
    are built per sequence): not for a captured CUDA graph. A head_dim the kernel's tiles cannot
    take (not a power of two >= 16) runs the reference."""
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
    cu, lens = cu_seqlens.tolist(), cache_lens.tolist()
    hists = history_lens_of(cache_lens, history_lens, sink, recent)
    g = H_q // H_kv
    block_m = max(1, block_rows // g)
    blocks = [(i, t0) for i in range(len(lens)) for t0 in range(0, cu[i + 1] - cu[i], block_m)]
    if not blocks:
        return out
    dot_dt = dot_dtype(q.dtype)
    rules = (sink, recent, bits, group_size, clip_k, clip_v, torch.float32 if dot_dt == tl.float32 else q.dtype)
    views, vstart = packed_views(k, v, cu, lens, hists, (window_table, quant_table), pools, *rules)
    bseq, bt0 = torch.tensor(blocks, dtype=torch.int32, device=q.device).T.contiguous()
    hist = torch.tensor(hists, dtype=torch.int32, device=q.device)
    _decode_consistent_kernel[(len(blocks), H_kv)](
        q, k, v, out, cu_seqlens, cache_lens, hist, vstart, bseq, bt0, *views, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H_KV=H_kv, G_Q=g, D=D, SINK=sink, RECENT=recent, BLOCK_M=block_m,
        ROWS=max(16, triton.next_power_of_2(block_m * g)), BLOCK_N=block_n, DOT_DT=dot_dt,
        IEEE=dot_dt == tl.float32, ALIGNED=is_deterministic(), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def compile_offline(
    dtype: str = "bf16",
    head_dim: int = 128,
    num_q_per_kv: int = 4,
    block_rows: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    aligned: bool = False,
):
    """Compile the kernel for sm_90 without a GPU (CI: it must build for the device, not only run
    in the interpreter). ``dtype``: q, k, v, the views and the output ("bf16", "fp16" or "fp32"). Returns
    Triton's compiled kernel (``.asm["ptx"]``, ``.metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = dict(q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, out_ptr=dtype, cu_ptr="i32", lens_ptr="i32", hist_ptr="i32",
                vstart_ptr="i32", bseq_ptr="i32", bt0_ptr="i32", ke_ptr=dtype, kh_ptr=dtype, ve_ptr=dtype,
                vh_ptr=dtype)  # fmt: skip
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig.update(qk_scale="fp32", sqn="i32", sqh="i32", skn="i32", skh="i32", svn="i32", svh="i32")
    block_m = max(1, block_rows // num_q_per_kv)
    dot_dt = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}[dtype]
    consts = dict(H_KV=8, G_Q=num_q_per_kv, D=head_dim, SINK=64, RECENT=256, BLOCK_M=block_m,
                  ROWS=max(16, triton.next_power_of_2(block_m * num_q_per_kv)), BLOCK_N=block_n, DOT_DT=dot_dt,
                  IEEE=dot_dt == tl.float32, ALIGNED=aligned)  # fmt: skip
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}  # as the JIT specializes pointers
    src = ASTSource(_decode_consistent_kernel, sig, consts, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
