"""Gluon ``oscar::attention`` for Hopper on 8-bit integer tensor cores: INT2 decode on codes masked in place.

Why: the fp16-operand Gluon kernel (attention_gluon.py) is bound by issue, at 640 instructions per
thread per 128 tokens, most of them decoding codes into fp16. ``wgmma.m64n8k32.s32.s8.s8`` takes
integer codes as they are: with the masked code layout (attention_gluon_int8_tiles.py,
docs/cache-format.md) one LOP3 turns a stored word into an A register, and a 128-token step takes
467 instructions. H200, bench/results/2026-12-03-h200-int2-decode-int8-product (one run): 4.21x
cuDNN BF16 at 128k / 32 (64 % of HBM) and 4.66x at 32k / 32, against 3.17x and 3.45x for the
fp16-operand kernel; 3.80x at 128k / 1, 1.66x at 8k / 1 (latency-bound, see that README).

- **One warpgroup per program, 128 history tokens per step, the query heads on N = 8.** Keys:
  S^T [128 tokens, 8] = codes [128, 128 channels] . q^T, four k32 wgmma with one s32 accumulator
  each; values: O^T [128 channels, 8] += V^T codes [128, 128 tokens] . P'^T (P' in shared memory).
  Score rows are tokens relabelled (row m <-> token ``tau`` below) so that each stored byte holds
  4 consecutive tokens of one page; P' row m is stored at the value K of the same token.
- **The top bit pair is stored as (c + 2) mod 4** (the s8 read gives 64 (c - 2)); the shift
  folds into the key zero per token and into a rank-1 term sum(P') for values.
- **The query in int8 with one scale per 32-channel group** (integer multipliers of one base, the
  four accumulators combined in integer, one I2F per score), **P' = P s_v in 8 bits** relative to
  the running maximum (log2 s_v added to the score). The 4 padding columns of N = 8 carry the low
  halves of both (a ~15-bit query and P' at the same 16 wgmma per step), which is what keeps the
  error at the fp16 kernel's level; so a program takes at most 4 query heads: larger groups are
  split over ``G / heads_per_program`` programs per KV head, which read the same codes (from L2
  when they run together).
- Online softmax in fp32; flash-decoding splits of whole 128-token steps plus the 16-bit window
  programs of attention_gluon (``_window_part``: sink, recent and the token's own chunk) in the
  same launch; the partials are merged by ``merge_partials``, or in deterministic mode by
  ``merge_partials_in_order`` (below).
- **Deterministic mode** (issue #31's ``deterministic=True``): history splits of a fixed
  ``DET_SPLIT_TOKENS``, aligned to absolute history positions, a fixed number of window programs,
  and a merge that folds the partials one by one in split order. An empty partial folds in as an
  exact no-op, so the output does not depend on how many splits the table width asks for: a
  token's result is bitwise the same in any batch and at any table width.

Scope (``int8_unsupported_reason``): sm_90, INT2, head_dim 128 (a value tile needs 128 channels on M;
head_dim 64 runs attention_gluon), one fp16 scale group per token, pages of 16 tokens (the layout's
unit), 16-bit windows, decode-like batches (at most 2 tokens per sequence), any GQA group (1-16 and
beyond). The pools must hold the masked code layout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from oscar_compile.kernels.attention.attention_blocks_triton import merge_partials
from oscar_compile.kernels.attention.decode import gluon_host
from oscar_compile.kernels.attention.decode.attention_gluon import _window_part
from oscar_compile.kernels.attention.decode.attention_gluon_int8_tiles import (
    MAGIC,
    STEP,
    STEP_TOKENS,
    _ex2,
    _key_operands,
    _lg2,
    _load_step,
    _mma8,
    _partner,
    _q_group,
    _q_store,
    _rcp,
    _rows,
    _thread_rows_sum,
    _tile_max128,
    _value_operand,
)
from oscar_compile.kernels.attention.decode.attention_gluon_tiles import (
    NEG_INIT,
    _mma_layout,
    _store_partial,
    _token_state,
)
from oscar_compile.kernels.attention.decode.attention_triton import LOG2E, MAX_SPLIT_TOKENS, plan_window_splits
from oscar_compile.kernels.device import num_sms
from oscar_compile.kernels.gluon_compat import (
    fence_async_shared,
    gl,
    gluon,
    thread_barrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

NH_INT8 = 8  # the wgmma N: 4 query heads and their 4 low halves
MAX_HEADS_PER_PROGRAM = NH_INT8 // 2


@gluon.jit
def _history_int8(q_row, sqh, qt_row, kvh, lo, hi, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                  q_s0, q_s1, q_s2, q_s3, p_smem, red_smem, qk_scale, H_KV: gl.constexpr, G_Q: gl.constexpr,
                  NH: gl.constexpr, EARLY: gl.constexpr):
    """History tokens [lo, hi) (lo a multiple of 128): (O^T [128, NH] unnormalised, m, l)."""
    mma: gl.constexpr = _mma8(NH)
    colL: gl.constexpr = gl.SliceLayout(0, mma)
    rowL: gl.constexpr = gl.SliceLayout(1, mma)
    if EARLY:  # the first step's page-table and code loads in flight during the query work (see EARLY_STEPS)
        kb, vb, ks, kz, vs, vz = _load_step(lo, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                                            H_KV)
    # ---- the query: int8 + low half, one integer multiplier per 32-channel group
    x0, am0, rows = _q_group(q_row, sqh, 0, G_Q, NH)
    x1, am1, rows = _q_group(q_row, sqh, 1, G_Q, NH)
    x2, am2, rows = _q_group(q_row, sqh, 2, G_Q, NH)
    x3, am3, rows = _q_group(q_row, sqh, 3, G_Q, NH)
    amax = gl.maximum(gl.max(gl.maximum(gl.maximum(am0, am1), gl.maximum(am2, am3)), axis=0), 1e-30)
    unit = amax / 512.0
    base = amax / (127.0 * 512.0)
    m0, qs0 = _q_store(x0, am0, rows, unit, base, q_s0, NH)
    m1, qs1 = _q_store(x1, am1, rows, unit, base, q_s1, NH)
    m2, qs2 = _q_store(x2, am2, rows, unit, base, q_s2, NH)
    m3, qs3 = _q_store(x3, am3, rows, unit, base, q_s3, NH)
    QS = gl.convert_layout((qs0 + qs1 + qs2 + qs3).to(gl.float32), colL)
    m0 = gl.expand_dims(gl.convert_layout(m0, colL), 0)
    m1 = gl.expand_dims(gl.convert_layout(m1, colL), 0)
    m2 = gl.expand_dims(gl.convert_layout(m2, colL), 0)
    m3 = gl.expand_dims(gl.convert_layout(m3, colL), 0)
    fence_async_shared()
    thread_barrier()
    # ---- per-row constants: row m = 64 j1 + 16 w + 8 j0 + g <-> step token tau
    mr = gl.arange(0, 128, layout=rowL)
    gq = mr & 7
    jj = ((mr >> 3) & 1) + 2 * (mr >> 6)
    tau = 16 * (2 * ((mr >> 4) & 3) + (gq >> 2)) + 4 * (gq & 3) + jj
    pow4 = (1 << (2 * jj)).to(gl.float32)
    kmul = qk_scale * base / pow4  # a_t = s_t qk base 4^-j
    zfix = gl.where(jj == 3, 2.0, 0.0)
    vmul = gl.expand_dims(gl.where(((mr >> 3) & 9) == 9, 2.0, 0.0), 1)  # value rows (channels) with j = 3
    vpow = gl.expand_dims(1.0 / pow4, 1)
    QSr = gl.expand_dims(QS, 0)
    colv = gl.arange(0, NH, layout=colL)
    is_lo = gl.expand_dims(colv >= NH // 2, 0)
    wq = gl.where(is_lo, 1.0 / 128.0, 1.0)  # own / partner weights: full = hi + lo / 128 in every column
    wp = gl.where(is_lo, 1.0, 1.0 / 128.0)
    p_s = gl.where(is_lo, 16256.0, 127.0)  # P' low half: round(128 * 127 pp - 128 hi)
    p_t = gl.where(is_lo, -128.0, 0.0)
    m_i = gl.full([NH], NEG_INIT, gl.float32, layout=colL)
    o = gl.zeros([128, NH], gl.float32, layout=mma)
    zi = gl.zeros([128, NH], gl.int32, layout=mma)
    zero3 = _thread_rows_sum(gl.zeros([128, NH], gl.float32, layout=mma), NH)
    l_acc = zero3
    ps_acc = zero3
    zs_acc = zero3
    L3: gl.constexpr = zero3.type.layout
    c3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, L3))
    if not EARLY:
        kb, vb, ks, kz, vs, vz = _load_step(lo, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                                            H_KV)
    for n0 in range(lo, hi, STEP):
        # the next step's loads in flight during this step's math
        kb_n, vb_n, ks_n, kz_n, vs_n, vz_n = _load_step(n0 + STEP, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr,
                                                        kz_ptr, vs_ptr, vz_ptr, H_KV)
        ka0, ka1, ka2, ka3 = _key_operands(kb, NH)
        acc0 = warpgroup_mma(ka0, q_s0.permute((1, 0)), zi, use_acc=False, is_async=True)
        acc1 = warpgroup_mma(ka1, q_s1.permute((1, 0)), zi, use_acc=False, is_async=True)
        acc2 = warpgroup_mma(ka2, q_s2.permute((1, 0)), zi, use_acc=False, is_async=True)
        acc3 = warpgroup_mma(ka3, q_s3.permute((1, 0)), zi, use_acc=False, is_async=True)
        a_v = _value_operand(vb, NH)
        # per-row terms (while the key dots run)
        ok = n0 + tau < hi
        ksr = _rows(ks, NH)
        kzr = _rows(kz, NH)
        vsr = gl.maximum(_rows(vs, NH), 1e-30)
        vzr = _rows(vz, NH)
        a_t = gl.expand_dims(ksr * kmul, 1)  # (rows past hi: finite garbage times a finite scale, then + -inf)
        zz_t = gl.expand_dims((zfix - kzr) * pow4, 1)
        lv_t = gl.expand_dims(gl.where(ok, _lg2(vsr), float("-inf")), 1)
        ivs_t = gl.expand_dims(_rcp(vsr), 1)  # (masked rows: pp = 0)
        vz_t = gl.expand_dims(vzr, 1)
        # (one dependency per wait: the multi-dependency form's return differs between Triton releases)
        acc0 = warpgroup_mma_wait(num_outstanding=3, deps=(acc0,))
        acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc1,))
        acc2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc2,))
        acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc3,))
        y = (acc0 * m0 + acc1 * m1 + acc2 * m2 + acc3 * m3).to(gl.float32) + zz_t * QSr
        s = a_t * (_partner(y) * wp + y * wq) + lv_t  # s' = score (log2 units) + log2 s_v, hi + lo / 128
        m_new = gl.maximum(m_i, gl.maximum(_tile_max128(s, red_smem, NH), NEG_INIT))
        alpha = _ex2(m_i - m_new)
        m_i = m_new
        pp = _ex2(s - gl.expand_dims(m_new, 0))  # P s_v relative to the running max, in [0, 1]
        pf = pp * 127.0 + MAGIC
        pf = pp * p_s + ((pf - MAGIC) * p_t + MAGIC)  # hi = round(127 pp); lo = round(128 (127 pp - hi))
        pint = pf.to(gl.int32, bitcast=True).to(gl.int8)
        # P'^T into shared memory, K = a bit permutation of the row m (the value K of the same token)
        pk = gl.permute(gl.reshape(pint, [2, 2, 2, 2, 2, 2, 2, NH]), (5, 6, 1, 2, 4, 0, 3, 7))
        p_smem.store(gl.permute(gl.reshape(pk, [128, NH]), (1, 0)))
        fence_async_shared()
        acc_v = warpgroup_mma(a_v, p_smem.permute((1, 0)), zi, use_acc=False, is_async=True)
        # softmax sum and zero terms, per thread over its 4 rows (reduced once at the end); the
        # weights hi + lo / 128 equal 127 pp within 1 / 256, the 127 applied at the end
        ls = _thread_rows_sum(pp * ivs_t, NH)
        ps = _thread_rows_sum(pp, NH)
        zs = _thread_rows_sum(pp * vz_t, NH)
        al3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(alpha, c3), 0), 0)
        l_acc = l_acc * al3 + ls
        ps_acc = ps_acc * al3 + ps
        zs_acc = zs_acc * al3 + zs
        acc_v = warpgroup_mma_wait(num_outstanding=0, deps=(acc_v,))
        o = o * gl.expand_dims(alpha, 0) + acc_v.to(gl.float32)
        kb, vb, ks, kz, vs, vz = kb_n, vb_n, ks_n, kz_n, vs_n, vz_n
    l = gl.convert_layout(gl.sum(gl.sum(l_acc, axis=0), axis=0), colL)
    ps_t = gl.expand_dims(gl.convert_layout(gl.sum(gl.sum(ps_acc, axis=0), axis=0), colL), 0) * 127.0
    zs_t = gl.expand_dims(gl.convert_layout(gl.sum(gl.sum(zs_acc, axis=0), axis=0), colL), 0) * 127.0
    o = _partner(o) * wp + o * wq
    o = (o * vpow + vmul * ps_t - zs_t) * (1.0 / 127.0)
    return o, m_i, l


@gluon.jit
def _decode_int8_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, lens_ptr, hist_ptr, wt_ptr, qt_ptr,
    kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    po_ptr, pl_ptr, qk_scale, B, nsplit, nwin,
    sqn, sqh, skn, skh, svn, svh, stride_wt, stride_qt,
    H_KV: gl.constexpr, G_ALL: gl.constexpr, G_Q: gl.constexpr, NH: gl.constexpr, D: gl.constexpr,
    P: gl.constexpr, SINK: gl.constexpr, RECENT: gl.constexpr, HAS_HIST: gl.constexpr, DET_SPLIT: gl.constexpr,
    PDL: gl.constexpr = False, EARLY: gl.constexpr = False,
):
    """One program: query token n, KV head kvh and its head group hg (G_Q of its G_ALL query heads),
    split sid (< nsplit: history; else windows). DET_SPLIT > 0: history splits of that many tokens."""
    mma: gl.constexpr = _mma_layout(NH)
    NG: gl.constexpr = G_ALL // G_Q
    if PDL:  # the merge may launch once every program has started (it waits for our writes itself)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    n = gl.program_id(0)
    kvh = gl.program_id(1) // NG
    h0 = kvh * G_ALL + (gl.program_id(1) % NG) * G_Q  # the group's first query head
    sid = gl.program_id(2)
    i, start, L, n_hist = _token_state(cu_ptr, lens_ptr, hist_ptr, n, B, SINK, RECENT, HAS_HIST)
    t = n - start
    q_row = q_ptr + n.to(gl.int64) * sqn + h0 * sqh
    ns = nsplit + nwin
    head = gl.arange(0, NH, layout=gl.SliceLayout(0, mma))
    prow = (n.to(gl.int64) * (H_KV * G_ALL) + h0 + head) * ns + sid
    hok = head < G_Q
    m_rows = gl.arange(0, D, layout=gl.SliceLayout(1, mma))
    qlay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([NH, 32], gl.int8)
    q_s0 = gl.allocate_shared_memory(gl.int8, [NH, 32], qlay)
    q_s1 = gl.allocate_shared_memory(gl.int8, [NH, 32], qlay)
    q_s2 = gl.allocate_shared_memory(gl.int8, [NH, 32], qlay)
    q_s3 = gl.allocate_shared_memory(gl.int8, [NH, 32], qlay)
    p8 = gl.allocate_shared_memory(gl.int8, [NH, STEP], gl.NVMMASharedLayout.get_default_for([NH, STEP], gl.int8))
    wdt: gl.constexpr = kwin_ptr.dtype.element_ty
    q_smem_w = gl.allocate_shared_memory(wdt, [NH, D], gl.NVMMASharedLayout.get_default_for([NH, D], wdt))
    kv_smem = gl.allocate_shared_memory(wdt, [64, D], gl.NVMMASharedLayout.get_default_for([64, D], wdt))
    p_smem_w = gl.allocate_shared_memory(wdt, [64, NH], gl.NVMMASharedLayout.get_default_for([64, NH], wdt))
    red_smem = gl.allocate_shared_memory(gl.float32, [4, NH], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    if sid < nsplit:
        if DET_SPLIT > 0:
            chunk = DET_SPLIT
        else:
            chunk = ((n_hist + nsplit - 1) // nsplit + STEP - 1) // STEP * STEP
        lo = gl.minimum(sid * chunk, n_hist)
        hi = gl.minimum(lo + chunk, n_hist)
        o8, m_i, l = _history_int8(q_row, sqh, qt_ptr + i.to(gl.int64) * stride_qt, kvh, lo, hi,
                                   kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, q_s0, q_s1, q_s2, q_s3, p8,
                                   red_smem, qk_scale, H_KV, G_Q, NH, EARLY)
        o = gl.convert_layout(o8, mma)
        m_i = gl.convert_layout(m_i, gl.SliceLayout(0, mma))
        l = gl.convert_layout(l, gl.SliceLayout(0, mma))
    else:
        o, m_i, l = _window_part(q_row, sqh, wt_ptr + i.to(gl.int64) * stride_wt, kvh, sid - nsplit, nwin,
                                 L, n_hist, t, kwin_ptr, vwin_ptr, k_ptr + (start.to(gl.int64) * skn + kvh * skh),
                                 v_ptr + (start.to(gl.int64) * svn + kvh * svh), skn, svn, q_smem_w, kv_smem,
                                 p_smem_w, red_smem, qk_scale, H_KV, G_Q, NH, D, P, SINK, RECENT)
    _store_partial(po_ptr, pl_ptr, o, m_i, l, prow, m_rows, hok, m_rows, D)


@triton.jit(do_not_specialize=["NS"])
def _merge_in_order_kernel(po_ptr, pl_ptr, out_ptr, NS, D: tl.constexpr, PDL: tl.constexpr):
    """out[r] = the partials of row r folded one by one in split order (online softmax); an empty
    partial (lse -inf, o 0) leaves the running state bitwise unchanged."""
    r = tl.program_id(0)
    d = tl.arange(0, D)
    if PDL:
        gdc_wait()
    m = -float("inf")
    acc = tl.zeros([D], tl.float32)
    den = 0.0
    for s in range(NS):
        lse = tl.load(pl_ptr + r * NS + s)
        m_new = tl.maximum(m, lse)
        alpha = tl.where(m_new == -float("inf"), 1.0, tl.math.exp2(m - m_new))
        w = tl.where(lse == -float("inf"), 0.0, tl.math.exp2(lse - m_new))
        acc = acc * alpha + w * tl.load(po_ptr + (r * NS + s) * D + d)
        den = den * alpha + w
        m = m_new
    tl.store(out_ptr + r * D + d, (acc / den).to(out_ptr.dtype.element_ty))


def merge_partials_in_order(po, pl, out, num_partials: int, pdl: bool = False) -> None:
    """The deterministic merge: one program per output row, the partials in split order."""
    D = out.shape[-1]
    _merge_in_order_kernel[(out.numel() // D,)](po, pl, out, num_partials, D=D, PDL=pdl, num_warps=1, launch_pdl=pdl)


# ------------------------------------------------------------------ host side
def int8_unsupported_reason(q, k, k_win, k_codes, k_scale, bits: int, group_size: int, N: int, B: int) -> str | None:
    """Why this kernel does not take the call (None: it does). Shapes and dtypes only."""
    H_q, D = q.shape[1], q.shape[2]
    H_kv, P = k.shape[1], k_win.shape[2]
    if bits != 2:
        return f"bits {bits} (the 8-bit integer kernel is INT2)"
    if D != 128:
        return f"head_dim {D} (a value tile takes 128 channels)"
    if group_size != D:
        return f"group_size {group_size} below head_dim {D} (one scale group per token)"
    if k_scale.dtype != torch.float16:
        return f"scale dtype {k_scale.dtype} (fp16 only)"
    if P != 16:
        return f"page_size {P} (the masked layout's unit is a 16-token page)"
    if H_q % H_kv:
        return f"{H_q} query heads over {H_kv} KV heads"
    return gluon_host.decode_call_problem(q, k_win, N, B)


def heads_per_program(g: int) -> int:
    """The largest divisor of the GQA group that fits a program (4: the low halves take N's other 4)."""
    return max(d for d in range(1, MAX_HEADS_PER_PROGRAM + 1) if g % d == 0)


MAXNREG = 128  # 4 programs per SM; 96 spills (1.75x slower, prototype run 3)
PROGRAMS_PER_SM = 65536 // (MAXNREG * 128)
MIN_SPLIT_TOKENS = 2 * STEP_TOKENS  # shorter histories are not split
WINDOW_STEP_COST = 4  # history steps one 64-token BF16 window tile costs
# deterministic mode: history splits of this many tokens, aligned to position 0. H200 (results
# 2026-12-03-h200-int2-decode-int8-product, run 1): 4096 cost 3.9x the default plan at 8k / 1
# (two 32-step chains), 1.33x at 128k / 1 and 5-6 % at batch 32; 2048 is the default plan's own
# split at 128k / 1.
DET_SPLIT_TOKENS = 2048
PDL = False  # the merge as a programmatic dependent launch: off until measured (bench int8-variants)
# Splits of at most this many steps load their first step before the query work (a short program's
# prologue is a chain of dependent loads); longer ones after it: the early form keeps those values
# live into the loop, 477 instead of 467 instructions per step with 7 spill operations, not 3.
EARLY_STEPS = 8


def plan_int8_launch(N: int, H_kv: int, g: int, max_hist: int, sink: int, recent: int, device,
                     deterministic: bool = False) -> tuple[int, int]:
    """(nsplit, nwin) from shapes only (CUDA-graph safe): the history programs of one split
    (N * H_kv * head groups) sized to whole waves of the resident programs, at least 2 steps per
    split and at most MAX_SPLIT_TOKENS per split; the window programs share sink + recent so
    that their chain is no longer than a split's, within the wave's free slots when the history
    fits one wave (H200, run 1: 32k / 1, 64 splits + 6 window programs on 528 slots 17.0 µs,
    + 2 window programs 15.4 µs). Deterministic: DET_SPLIT_TOKENS per split and
    the window programs planned from that split alone (no batch or table width in either)."""
    win_tiles = triton.cdiv(sink + recent, 64) + 1
    if deterministic:
        nsplit = max(1, triton.cdiv(max_hist, DET_SPLIT_TOKENS))
        return nsplit, plan_window_splits(win_tiles, max(1, DET_SPLIT_TOKENS // STEP_TOKENS // WINDOW_STEP_COST))
    if max_hist <= MIN_SPLIT_TOKENS:
        return 1, 1  # (eager with trimmed tables and a full-width graph launch the same programs)
    slots = PROGRAMS_PER_SM * num_sms(device)
    per_split = N * H_kv * (g // heads_per_program(g))
    steps = triton.cdiv(max_hist, STEP_TOKENS)
    fit = max(1, slots // per_split)
    nsplit = min(fit, max(1, steps // 2))
    precision = triton.cdiv(max_hist, MAX_SPLIT_TOKENS)
    if precision > nsplit:  # several waves anyway: whole ones
        nsplit = triton.cdiv(precision, fit) * fit
    nsplit = triton.cdiv(steps, triton.cdiv(steps, nsplit))
    nwin = plan_window_splits(win_tiles, max(1, triton.cdiv(steps, nsplit) // WINDOW_STEP_COST))
    if nsplit < fit:  # one wave: the window programs take the slots left, not a second wave
        nwin = max(1, min(nwin, fit - nsplit))
    return nsplit, nwin


def early_load_for(max_hist: int, nsplit: int, deterministic: bool = False) -> bool:
    """The EARLY_STEPS rule: whether a split of this launch loads its first step before the query work."""
    split = DET_SPLIT_TOKENS if deterministic else triton.cdiv(max_hist, nsplit)
    return triton.cdiv(split, STEP_TOKENS) <= EARLY_STEPS


def _words(x: torch.Tensor) -> torch.Tensor:
    """A contiguous pool as int32 words (4 code bytes or 2 fp16 per word)."""
    return x.reshape(x.shape[0], x.shape[1], -1).view(torch.int32)


def attention_gluon_int8(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win,
                         k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, sink, recent, bits,
                         group_size, history_lens=None, nsplit: int | None = None,
                         win_splits: int | None = None, deterministic: bool = False, pdl: bool = PDL,
                         early_load: bool | None = None):
    """Check, plan and launch; the contract of ``oscar::attention`` with k_codes / v_codes in the
    masked code layout. ``nsplit`` / ``win_splits`` override the plan (benchmark sweeps, tests);
    ``pdl``: the merge as a programmatic dependent launch (its launch overlaps the decode's tail);
    ``early_load`` overrides the EARLY_STEPS rule."""
    s, out = gluon_host.begin_decode("8-bit integer decode kernel", lambda N, B: int8_unsupported_reason(
        q, k, k_win, k_codes, k_scale, bits, group_size, N, B), q, k, v, cache_lens, k_win,
        (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), history_lens)
    if s.N == 0:
        return out
    gp = heads_per_program(s.g)
    max_hist = quant_table.shape[1] * s.P
    nsplit, nwin = gluon_host.fill_plan(nsplit, win_splits, lambda: plan_int8_launch(
        s.N, s.H_kv, s.g, max_hist, sink, recent, q.device, deterministic))
    ns = nsplit + nwin
    if early_load is None:
        early_load = early_load_for(max_hist, nsplit, deterministic)
    po, pl = gluon_host.split_partials(s, ns, q.device)
    code_pools = tuple(_words(x) for x in (k_codes, k_scale, k_zero, v_codes, v_scale, v_zero))
    _decode_int8_kernel[(s.N, s.H_kv * (s.g // gp), ns)](
        *gluon_host.decode_launch_args(
            q, k, v, cu_seqlens, cache_lens, history_lens, window_table, quant_table, k_win, v_win, code_pools,
            po, pl, scale * LOG2E, nsplit, nwin),
        H_KV=s.H_kv, G_ALL=s.g, G_Q=gp, NH=NH_INT8, D=s.D, P=s.P, SINK=sink, RECENT=recent,
        HAS_HIST=history_lens is not None, DET_SPLIT=DET_SPLIT_TOKENS if deterministic else 0, PDL=pdl,
        EARLY=early_load,
        num_warps=4, maxnreg=MAXNREG,
    )
    if deterministic:
        merge_partials_in_order(po, pl, out, ns, pdl)
    else:
        merge_partials(po, pl, out, ns, pdl=pdl)
    return out


def compile_offline(num_q_per_kv: int = 4, num_kv_heads: int = 8, sink: int = 64, recent: int = 256,
                    window_dtype: str = "bf16", has_hist: bool = False, deterministic: bool = False,
                    pdl: bool = False, early_load: bool = False):
    """Compile the kernel for sm_90 without a GPU (CI, and the SASS counts of the results README;
    ``gluon_host.compile_decode_offline``)."""
    consts = {"H_KV": num_kv_heads, "G_ALL": num_q_per_kv, "G_Q": heads_per_program(num_q_per_kv), "NH": NH_INT8,
              "D": 128, "P": 16, "SINK": sink, "RECENT": recent, "HAS_HIST": has_hist,
              "DET_SPLIT": DET_SPLIT_TOKENS if deterministic else 0, "PDL": pdl,
              "EARLY": early_load}
    return gluon_host.compile_decode_offline(_decode_int8_kernel, window_dtype, ("i32",) * 6, consts, MAXNREG)
