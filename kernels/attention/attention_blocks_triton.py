"""Triton building blocks shared by the paged attention kernels (INT-b history and full precision).

Online softmax in base 2 (scores pre-multiplied by scale * log2(e)). The state of one program is
m, l: [ROWS] and the output accumulator split by *plane*: a0..a3: [ROWS, WP] float32, where plane
i holds channels [i * WP, (i + 1) * WP) (WP = D * b / 8, the packed row width). Splitting the
accumulator the way codes are packed lets the INT-b blocks run one tensor-core dot per plane
straight from the unpacked bytes, with no re-interleaving; the full-precision blocks simply load
V one plane-wide column block at a time. z0..z3: [ROWS] carry, per plane, the value zero-point
term sum_n p_n s_n z_n that is subtracted once at the end (see history_block).

Scores start at -inf only where masked; m starts at -1e30 (finite), so a block with every key
masked gives alpha = 1 and p = 0 instead of NaN.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from oscar_compile.kernels.layout.code_decode_triton import decode_plane
from oscar_compile.kernels.layout.code_layout_triton import (
    join_key_pairs,
    load_masked_key_plane,
    load_masked_planar_bytes,
    load_masked_value_bytes,
    load_planar_bytes,
    masked_block_rows,
    value_columns,
)

NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def pick4(IDX: tl.constexpr, x0, x1, x2, x3):
    """x_IDX for a compile-time IDX (Triton has no run-time indexing of a tuple of tensors)."""
    if IDX == 0:
        out = x0
    elif IDX == 1:
        out = x1
    elif IDX == 2:
        out = x2
    else:
        out = x3
    return out


@triton.jit
def seq_of_rows(cu_ptr, n, B, CHUNK: tl.constexpr = 128):
    """Per element of n: the largest i in [0, B) with cu[i] <= n (cu non-decreasing, cu[0] = 0;
    empty sequences are skipped), counted as #{j in [1, B]: cu[j] <= n}: rounds of CHUNK
    independent loads instead of a binary search's log2(B) dependent ones, and no compile-time
    step count. (On the H200 the cache write got 2-12 % faster per decode step, the attention
    kernels no faster: the search was not what bounded them.)"""
    count = tl.zeros_like(n)
    for c0 in range(1, B + 1, CHUNK):
        j = c0 + tl.arange(0, CHUNK)
        bound = tl.load(cu_ptr + j, mask=j <= B, other=2147483647)
        count += tl.sum((bound[None, :] <= n[:, None]).to(n.dtype), axis=1)
    return count


@triton.jit
def seq_of_program(cub_ptr, pid, B):
    """seq_of_rows for one scalar (a program's first block index in the block prefix cub)."""
    return tl.sum(seq_of_rows(cub_ptr, tl.zeros([1], tl.int32) + pid, B), axis=0)


@triton.jit
def program_ids(cub_ptr, B):
    """(pid, KV head, split, sequence) of this program of a (query blocks, H_kv, splits) grid."""
    pid = tl.program_id(0)
    return pid, tl.program_id(1), tl.program_id(2), seq_of_program(cub_ptr, pid, B)


@triton.jit
def query_rows(q_ptr, cu_ptr, cub_ptr, lens_ptr, pid, h, i, sqn, sqh, G_Q: tl.constexpr,
               BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
    """Where program ``pid`` of sequence i stands: (start, T, L, t0, r, tok, head, row_ok,
    q_rows). Its ROWS query rows are BLOCK_M chunk tokens from t0 times the G_Q query heads of
    KV head h (row r: token tok = t0 + r // G_Q, query head h G_Q + r % G_Q), q_rows: [ROWS, 1]
    pointers to their first channel."""
    start = tl.load(cu_ptr + i)
    T = tl.load(cu_ptr + i + 1) - start
    L = tl.load(lens_ptr + i)
    t0 = (pid - tl.load(cub_ptr + i)) * BLOCK_M
    r = tl.arange(0, ROWS)
    tok = t0 + r // G_Q
    head = h * G_Q + r % G_Q
    row_ok = (r < BLOCK_M * G_Q) & (tok < T)
    q_rows = q_ptr + (start + tok).to(tl.int64)[:, None] * sqn + head[:, None] * sqh
    return start, T, L, t0, r, tok, head, row_ok, q_rows


@triton.jit
def split_range(n, sid, nsplit, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_LEN: tl.constexpr):
    """(do_hist, do_win, lo, hi) of program ``sid`` along the split axis, over ``n`` cached keys.

    With SPLIT, programs 0 .. nsplit - 1 take equal whole-block parts of [0, n) and program nsplit
    takes the windows and the chunk; without, the one program takes everything. SPLIT_LEN > 0
    (deterministic mode): parts of SPLIT_LEN keys from key 0 instead, the last ones maybe empty.
    (The INT-b kernel spells the same computation out: through this helper it ran slower on the H200.)
    """
    if SPLIT:
        do_hist = sid < nsplit
        do_win = sid == nsplit
        if SPLIT_LEN > 0:
            chunk = SPLIT_LEN
        else:
            chunk = tl.cdiv(tl.cdiv(n, nsplit), BLOCK_N) * BLOCK_N
        lo = tl.minimum(sid * chunk, n)
        hi = tl.minimum(lo + chunk, n)
    else:
        do_hist = sid >= 0
        do_win = sid >= 0
        lo = n * 0
        hi = n
    return do_hist, do_win, lo, hi


@triton.jit
def softmax_step(s, m, l):
    """One online-softmax step on base-2 scores s: [ROWS, BN] -> (p, alpha, m, l)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l


@triton.jit
def full_block(q, m, l, a0, a1, a2, a3, z0, z1, z2, z3, k_base, v_base, rows, key_ok,
               k_stride, v_stride, qk_scale, D: tl.constexpr, WP: tl.constexpr, NPL: tl.constexpr,
               kdt: tl.constexpr, VMASKED: tl.constexpr = False):
    """Attend to BN full-precision keys/values at row offsets ``rows`` (masked by key_ok: [ROWS, BN]).

    q: [ROWS, D] in kdt (the window dtype; chunk keys are cast to it);
    k_base + rows * k_stride is a key's first channel, v_base + rows * v_stride its value's (the
    chunk's K and V are views of one merged projection or separate tensors: their strides differ).
    VMASKED: the accumulators hold the channels of the masked INT2 value planes (value_columns).
    """
    col_ok = tl.max(key_ok.to(tl.int32), axis=0) > 0  # [BN]
    d = tl.arange(0, D)
    kt = tl.load(k_base + rows[:, None] * k_stride + d[None, :], mask=col_ok[:, None], other=0.0)
    kt = kt.to(kdt)
    if kdt == tl.float32:
        s = tl.dot(q, tl.trans(kt), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(kt))
    s = tl.where(key_ok, s * qk_scale, float("-inf"))
    p, alpha, m, l = softmax_step(s, m, l)
    pk = p.to(kdt)
    vrow = v_base + rows[:, None] * v_stride
    a0 = _pv(a0 * alpha[:, None], pk, vrow + value_columns(0, WP, VMASKED)[None, :], col_ok, kdt)
    a1 = _pv(a1 * alpha[:, None], pk, vrow + value_columns(1, WP, VMASKED)[None, :], col_ok, kdt)
    if NPL == 4:
        a2 = _pv(a2 * alpha[:, None], pk, vrow + value_columns(2, WP, VMASKED)[None, :], col_ok, kdt)
        a3 = _pv(a3 * alpha[:, None], pk, vrow + value_columns(3, WP, VMASKED)[None, :], col_ok, kdt)
    return m, l, a0, a1, a2, a3, z0 * alpha, z1 * alpha, z2 * alpha, z3 * alpha


@triton.jit
def _pv(acc, p, vptrs, col_ok, kdt: tl.constexpr):
    vt = tl.load(vptrs, mask=col_ok[:, None], other=0.0).to(kdt)
    if kdt == tl.float32:
        out = tl.dot(p, vt, acc, input_precision="ieee")
    else:
        out = tl.dot(p, vt, acc)
    return out


@triton.jit
def history_rows(qt_row, n0, hi, h, H_KV: tl.constexpr, P: tl.constexpr, BN: tl.constexpr):
    """Flat pool rows [BN] of history tokens n0 .. n0 + BN of KV head h, and which are < hi."""
    hidx = n0 + tl.arange(0, BN)
    tmask = hidx < hi
    return page_rows(qt_row, hidx, tmask, h, H_KV, P), tmask


@triton.jit
def page_rows(table_row, idx, ok, h, H_KV: tl.constexpr, P: tl.constexpr):
    """Flat pool rows of KV head h for positions (or window slots) idx through one page-table
    row: page table_row[idx // P], row idx % P (idx masked by ok reads page 0)."""
    page = tl.load(table_row + idx // P, mask=ok, other=0)
    return (page.to(tl.int64) * H_KV + h) * P + idx % P


@triton.jit
def window_slot_of(p, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Window slot of positions p (pools.window_slot): p itself below SINK, else its ring slot
    (without a ring every window position is a sink slot)."""
    slot = p
    if RECENT > 0:
        slot = tl.where(p < SINK, p, SINK + (p - SINK) % RECENT)
    return slot


@triton.jit
def group_params(ks_ptr, kz_ptr, vs_ptr, vz_ptr, rowq, tmask, NG: tl.constexpr):
    """Key and value scales and zeros of rows ``rowq``: four [BN, NG] tiles, as stored."""
    off = rowq[:, None] * NG + tl.arange(0, NG)[None, :]
    msk = tmask[:, None]
    return (tl.load(ks_ptr + off, mask=msk, other=0.0), tl.load(kz_ptr + off, mask=msk, other=0.0),
            tl.load(vs_ptr + off, mask=msk, other=0.0), tl.load(vz_ptr + off, mask=msk, other=0.0))


@triton.jit
def _group(x, g: tl.constexpr, NG: tl.constexpr):
    """Column g of x: [BN, NG] as float32 [BN] (an exact pick: one non-zero term)."""
    if NG == 1:
        out = tl.reshape(x, [x.shape[0]]).to(tl.float32)
    else:
        out = tl.sum(tl.where(tl.arange(0, NG)[None, :] == g, x.to(tl.float32), 0.0), axis=1)
    return out


@triton.jit
def _key_group_fix(s, dg, PL: tl.constexpr, WP: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr,
                   ks, kz, qg, MASKED: tl.constexpr):
    """After the last plane of a group: s += scale * (dot - zero * sum(q over the group)).
    MASKED: dg holds token n's dot in units of 2^(2 (n % 4)) (its bit pair, _key_codes) and so
    does the zero term; the scale takes the inverse. Exact powers of two: the score's bits are
    the planar decode's."""
    if ((PL + 1) * WP) % GROUP == 0:
        g: tl.constexpr = (PL * WP) // GROUP
        sc = _group(ks, g, NG)
        zr = _group(kz, g, NG)
        if MASKED:
            e = 2 * (tl.arange(0, sc.shape[0]) % 4)
            sc = sc * ((127 - e) << 23).to(tl.float32, bitcast=True)
            zr = zr * ((127 + e) << 23).to(tl.float32, bitcast=True)
        s = s + sc[None, :] * (dg - zr[None, :] * qg[:, None])
        dg = dg * 0.0
    return s, dg


@triton.jit
def _key_codes(kb, kc_ptr, PL: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, MASKED: tl.constexpr):
    """Key codes of plane PL, [BN, WP] float16: decoded from the planar bytes kb [BN, WP], in
    units of 2^(BITS * PL + CODE_EXP); MASKED: read from the blocks at flat rows kb [BN / 16]
    (code_layout_triton), each bit pair with one AND, token n in units of 2^(2 (n % 4) + CODE_EXP)."""
    if MASKED:
        kp = load_masked_key_plane(kc_ptr, kb, PL)
        out = join_key_pairs(decode_plane(kp, 0, 2, USE_ASM), decode_plane(kp, 1, 2, USE_ASM),
                             decode_plane(kp, 2, 2, USE_ASM), decode_plane(kp, 3, 2, USE_ASM, True))
    else:
        out = decode_plane(kb, PL, BITS, USE_ASM)
    return out


@triton.jit
def _key_plane(s, dg, kb, kc_ptr, qp, qg, PL: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr,
               GROUP: tl.constexpr, NG: tl.constexpr, ks, kz, USE_ASM: tl.constexpr, MASKED: tl.constexpr):
    dg = tl.dot(qp, tl.trans(_key_codes(kb, kc_ptr, PL, BITS, USE_ASM, MASKED)), dg)
    return _key_group_fix(s, dg, PL, WP, GROUP, NG, ks, kz, qg, MASKED)


@triton.jit
def _value_plane(acc, al, zacc, pv, zs, vb, p, PL: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr,
                 GROUP: tl.constexpr, NG: tl.constexpr, vs, vz, USE_ASM: tl.constexpr, VMASKED: tl.constexpr,
                 PROMOTE: tl.constexpr):
    """acc = acc * al + (p * s_g) @ codes; zacc += sum_n p s_g z_g, with (pv, zs) recomputed at a
    group start. VMASKED: vb holds masked value bytes and plane PL is their bit pair PL (value_columns).

    PROMOTE: the tile's dot starts from zero and joins acc in one fused multiply-add, rounded to
    nearest, instead of accumulating into acc inside the MMA. The codes are non-negative, so acc
    is a sum of positive terms, about sqrt(n) times the output once the zero term is subtracted
    (flat attention over n keys); the tensor cores' accumulation truncates, and over a whole 128k
    history in one program (prefill's history partial) that bias reached percents of the output
    (bench/results/2026-12-05-gpu-int2-prefill-end-to-end, calls 17 and 25). It holds a second
    tile of registers: decode, whose splits bound each program's history, keeps its 128-register
    cap without spills by accumulating in the MMA."""
    if (PL * WP) % GROUP == 0:
        g: tl.constexpr = (PL * WP) // GROUP
        sc = _group(vs, g, NG)
        zr = _group(vz, g, NG)
        pv = (p * sc[None, :]).to(tl.float16)
        zs = tl.sum(pv.to(tl.float32) * zr[None, :], axis=1)
    codes = decode_plane(vb, PL, BITS, USE_ASM, VMASKED and PL == 3)
    if PROMOTE:
        tile = tl.dot(pv, codes)
        acc = tl.fma(acc, tl.broadcast_to(al, tile.shape), tile)
    else:
        acc = tl.dot(pv, codes, acc * al)
    return acc, zacc + zs, pv, zs


@triton.jit
def history_block(q0, q1, q2, q3, g0, g1, g2, g3, m, l, a0, a1, a2, a3, z0, z1, z2, z3,
                  kc_ptr, vc_ptr, ks, kz, vs, vz, rowq, tmask, qk_scale,
                  ROWS: tl.constexpr, BN: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr,
                  GROUP: tl.constexpr, NG: tl.constexpr, NPL: tl.constexpr, USE_ASM: tl.constexpr,
                  MASKED: tl.constexpr, VMASKED: tl.constexpr, PROMOTE: tl.constexpr):
    """Attend to BN quantized history tokens (flat pool rows ``rowq``: [BN], masked by tmask).

    Keys, with k = s (c - z) per group: q . k = sum_g s_g (q_g . c_g - z_g * sum(q_g)), so the
    dots run on codes and the scale/zero cost two multiply-adds per score. Values:
    sum_n p_n s_n (c_n - z_n) = (p s) @ c - sum_n p_n s_n z_n; the second term is one number per
    row and group (z0..z3), subtracted when the output is written.
    Over masked INT2 pages (MASKED; the tile's first token a multiple of 16) the 16-token blocks
    are read whole: key planes decoded per bit pair (token) and joined back into token order,
    values decoded per bit pair into the accumulators of that pair's channels (VMASKED, when no
    quantization group splits those channels; else rebuilt into planar bytes in registers).
    Units: decoded codes of plane i are c * 2^(BITS * i + CODE_EXP) (decode_plane), so the caller
    passes q planes divided by 2^(BITS * i) (undivided when MASKED: the key dots come in units
    of the token's bit pair, _key_group_fix), group sums g0..g3 times 2^CODE_EXP and qk_scale
    times 2^-CODE_EXP; a_i accumulates in units of plane i's factor (the caller rescales).
    q0..q3: [ROWS, WP] fp16; ks, kz, vs, vz: [BN, NG] scales / zeros (group_params).
    PROMOTE: each tile's value sums join the accumulators rounded to nearest (_value_plane).
    """
    if MASKED:
        kb = masked_block_rows(rowq, BN)  # [BN / 16] flat rows of the tile's blocks
    else:
        kb = load_planar_bytes(kc_ptr, rowq, tmask, WP)  # [BN, WP] u8
    if VMASKED:
        vb = load_masked_value_bytes(vc_ptr, kb)  # [BN, 32] u8, column 8 w + g
    elif MASKED:
        vb = load_masked_planar_bytes(vc_ptr, kb, False)  # [BN, 32] u8 planar
    else:
        vb = load_planar_bytes(vc_ptr, rowq, tmask, WP)
    s = tl.zeros([ROWS, BN], tl.float32)
    dg = tl.zeros([ROWS, BN], tl.float32)
    s, dg = _key_plane(s, dg, kb, kc_ptr, q0, pick4((0 * WP) // GROUP, g0, g1, g2, g3), 0, BITS, WP,
                       GROUP, NG, ks, kz, USE_ASM, MASKED)
    s, dg = _key_plane(s, dg, kb, kc_ptr, q1, pick4((1 * WP) // GROUP, g0, g1, g2, g3), 1, BITS, WP,
                       GROUP, NG, ks, kz, USE_ASM, MASKED)
    if NPL == 4:
        s, dg = _key_plane(s, dg, kb, kc_ptr, q2, pick4((2 * WP) // GROUP, g0, g1, g2, g3), 2, BITS,
                           WP, GROUP, NG, ks, kz, USE_ASM, MASKED)
        s, dg = _key_plane(s, dg, kb, kc_ptr, q3, pick4((3 * WP) // GROUP, g0, g1, g2, g3), 3, BITS,
                           WP, GROUP, NG, ks, kz, USE_ASM, MASKED)
    s = tl.where(tmask[None, :], s * qk_scale, float("-inf"))
    p, alpha, m, l = softmax_step(s, m, l)
    al = alpha[:, None]
    pv = tl.zeros([ROWS, BN], tl.float16)
    zs = tl.zeros([ROWS], tl.float32)
    a0, z0, pv, zs = _value_plane(a0, al, z0 * alpha, pv, zs, vb, p, 0, BITS, WP, GROUP, NG,
                                  vs, vz, USE_ASM, VMASKED, PROMOTE)
    a1, z1, pv, zs = _value_plane(a1, al, z1 * alpha, pv, zs, vb, p, 1, BITS, WP, GROUP, NG,
                                  vs, vz, USE_ASM, VMASKED, PROMOTE)
    if NPL == 4:
        a2, z2, pv, zs = _value_plane(a2, al, z2 * alpha, pv, zs, vb, p, 2, BITS, WP, GROUP, NG,
                                      vs, vz, USE_ASM, VMASKED, PROMOTE)
        a3, z3, pv, zs = _value_plane(a3, al, z3 * alpha, pv, zs, vb, p, 3, BITS, WP, GROUP, NG,
                                      vs, vz, USE_ASM, VMASKED, PROMOTE)
    return m, l, a0, a1, a2, a3, z0, z1, z2, z3


@triton.jit
def store_rows(base, rows_ok, a0, a1, a2, a3, z0, z1, z2, z3, inv_l, WP: tl.constexpr,
               NPL: tl.constexpr, VMASKED: tl.constexpr = False):
    """Write (a_i - z_i) * inv_l per plane to base + [ROWS, 1] offsets (plane i at the channels
    value_columns names: column i * WP on, or the masked INT2 value plane's, VMASKED)."""
    dt = base.dtype.element_ty
    msk = rows_ok[:, None]
    tl.store(base + value_columns(0, WP, VMASKED)[None, :], ((a0 - z0[:, None]) * inv_l[:, None]).to(dt), mask=msk)
    tl.store(base + value_columns(1, WP, VMASKED)[None, :], ((a1 - z1[:, None]) * inv_l[:, None]).to(dt), mask=msk)
    if NPL == 4:
        tl.store(base + value_columns(2, WP, VMASKED)[None, :], ((a2 - z2[:, None]) * inv_l[:, None]).to(dt),
                 mask=msk)
        tl.store(base + value_columns(3, WP, VMASKED)[None, :], ((a3 - z3[:, None]) * inv_l[:, None]).to(dt),
                 mask=msk)


@triton.jit(do_not_specialize=["NS"])
def merge_kernel(po_ptr, pl_ptr, out_ptr, NS, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 NS_P2: tl.constexpr, PDL: tl.constexpr = False):
    """out[r] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max); one program per (token, head)
    row and BLOCK_D columns. PDL: launched as a programmatic dependent of the kernel that wrote
    the partials, it waits for that kernel's writes here."""
    r = tl.program_id(0)
    if PDL:
        gdc_wait()
    sidx = tl.arange(0, NS_P2)
    ok = sidx < NS
    lse = tl.load(pl_ptr + r * NS + sidx, mask=ok, other=float("-inf"))
    w = tl.math.exp2(lse - tl.max(lse, axis=0))
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    o = tl.load(po_ptr + (r * NS + sidx[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + r * D + d, res.to(out_ptr.dtype.element_ty))


def merge_partials(po, pl, out, num_partials: int, block_d: int = 32, pdl: bool = False) -> None:
    """Combine num_partials normalised partials per output row (po: [rows * num_partials, D],
    pl: their log2-sum-exps) into out: [..., D]. Columns in blocks of ``block_d``: at batch 1 a
    program per (row, all of D) left the merge a chain of large loads on 32 programs (H200: 5 µs at
    128k, 66 partials). ``pdl``: a programmatic dependent launch (sm_90), for a writer that lets
    its dependents launch early (attention_gluon_int8)."""
    D = out.shape[-1]
    bd = min(block_d, D)
    merge_kernel[(out.numel() // D, D // bd)](po, pl, out, num_partials, D=D, BLOCK_D=bd,
                                              NS_P2=triton.next_power_of_2(num_partials), PDL=pdl, num_warps=4,
                                              launch_pdl=pdl)
