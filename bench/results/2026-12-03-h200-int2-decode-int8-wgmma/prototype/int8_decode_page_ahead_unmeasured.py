"""PROTOTYPE (issue #32), not product code: Hopper INT2 decode attention with 8-bit integer wgmma
(m64n8k32, s32 accumulate, A from registers) on 2-bit codes masked in place.

Design (one warpgroup per program, 128 history tokens per step, GQA heads on N = 8):

* Codes masked in place. In the 8-bit A fragment, thread (warp w, lane 4 g + t) holds rows
  r = 16 w + g, r + 8, r + 64, r + 72 (two m64 tiles) and, per k32 block, K columns 4 t .. 4 t + 3
  and 16 + 4 t .. 16 + 4 t + 3. Each stored 32-bit word holds, in byte b, one K column and in bit
  pair j (bits 2 j, 2 j + 1) row j of those 4 (j = j0 + 2 j1 <-> row r + 8 j0 + 64 j1). So
  ``w & (0x03030303 << 2 j)`` IS an A register (4 codes times 4^j): one LOP3 per 4 codes.
  The top bit pair (j = 3) is stored as (c + 2) mod 4: the signed .s8 read gives 64 (c - 2).
* Keys (A = codes [128 tokens, 128 channels], B = int8 query [128, 8]): row m of the score tile is
  token tau = 16 pi + 4 q + j of the step (pi = 2 w + g >> 2 the step's page, q = g & 3, j as
  above): the 4 tokens of a byte are 4 consecutive tokens of one page (a write ORs its bit pairs).
  Page-local key byte  128 q + 32 t + 8 s + 4 hh + b  holds channel 32 s + 16 hh + 4 t + b of
  tokens 4 q + j (bit pair j).
* Values (A = V^T codes [128 channels, 128 tokens], B = P'^T [128 tokens, 8] in shared memory):
  page-local value byte  16 (8 w + g) + 4 s + b  holds token 4 s + b of the page, channels
  16 w + g + 8 j0 + 64 j1 in bit pair j (a token owns whole bytes). The value K index of token
  (page pi, 4 s + b) is 32 s + 16 (pi >> 2) + 4 (pi & 3) + b, so a thread reads 16 contiguous
  bytes from each of 2 pages, and P' row m goes to K = bit permutation of m (free relabel).
* Query in int8 with one scale per 32-channel group: sq_g = base * m_g with integer multipliers
  m_g in [1, 512] (base = max|q| / (127 * 512) over the program's heads), one s32 accumulator per
  k32 step, combined in INTEGER: X = sum_g m_g acc_g (|X| < 2^31 guaranteed), one I2F per score.
  q . k_t = s_t base (4^-j X - z^_t QS),  z^_t = z_t - 2 [j = 3],  QS = sum_g m_g sum qi.
* P' = P s_t in 8 bits scaled by the step's own per-head maximum: log2(s_t) is added to the
  score (s' = s + log2 s_t), so exp2(s' - max_step s') in [0, 1] is P s_t relative to the step max;
  P'_int = round(127 exp2(...)) by the magic-number FFMA (no F2I); the softmax sum uses
  exp2(s' - m) / s_t. O^T[c] += beta (4^-j(c) acc_v[c] + 2 [j(c) = 3] PS - ZS) / 127 with
  PS = sum P'_int, ZS = sum z_t P'_int (kept per thread, reduced once).
* Online softmax in fp32 across steps; flash-decoding splits of whole 128-token steps plus the
  16-bit window programs of today's Gluon kernel (``_window_part``), merged by ``merge_partials``.
* Loads: plain LDG of the step's codes straight into the A-fragment registers (2 x 16 B keys,
  2 x 16 B values, 4 x 8 B scale/zero per thread), prefetched one step ahead (no cp.async yet).

Page size must be 16; head_dim 128; G_Q <= 8 (N = 8).
"""
from __future__ import annotations

import torch
import triton

from oscar_compile.kernels.attention_blocks_triton import merge_partials
from oscar_compile.kernels.attention_gluon import _window_part
from oscar_compile.kernels.attention_gluon_tiles import NEG_INIT, _mma_layout, _seq_of_token
from oscar_compile.kernels.attention_triton import LOG2E, MAX_SPLIT_TOKENS, plan_window_splits
from oscar_compile.kernels.gluon_compat import (
    async_copy,
    commit_group,
    wait_group,
    fence_async_shared,
    gl,
    gluon,
    thread_barrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from oscar_compile.kernels.pools import attention_output_for

STEP_TOKENS = 128
STEP = gl.constexpr(STEP_TOKENS)
MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2^23: x + MAGIC holds round(x) in its low mantissa bits
MULT = 512  # largest query group multiplier
# one 32-bit word (broadcast over the 4 byte positions of the output: 4 int32 operands, $4 used)
# -> 4 int8x4 outputs, output j = word & (0x03030303 << 2 j): the A register of row j
MASK4 = gl.constexpr("and.b32 $0, $4, 0x03030303; and.b32 $1, $4, 0x0C0C0C0C; "
                     "and.b32 $2, $4, 0x30303030; and.b32 $3, $4, 0xC0C0C0C0;")
EX2 = gl.constexpr("ex2.approx.ftz.f32 $0, $1;")
LG2 = gl.constexpr("lg2.approx.ftz.f32 $0, $1;")
RCP = gl.constexpr("rcp.approx.ftz.f32 $0, $1;")
SHFL2 = gl.constexpr("shfl.sync.bfly.b32 $0, $1, 2, 31, -1;")
HALF2 = gl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }")


# ------------------------------------------------------------------ layouts
@gluon.constexpr_function
def _mma8(NH):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 32])


@gluon.constexpr_function
def _key_load_layout():
    """[4 w, 8 g, 4 t, 8 words (s, hh)]: thread (w, 4 g + t) holds the 8 key words of its A rows."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 8])


@gluon.constexpr_function
def _key_bytes_layout():
    """[4 w, 8 g, 4 t, 4 s, 2 hh, 4 b]: the words broadcast over their byte positions b."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2], [0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 2, 0, 0]],
        lane_bases=[[0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 4, 0, 0, 0, 0]],
        warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 4, 2, 4])


@gluon.constexpr_function
def _val_load_layout():
    """[4 w, 8 g, 4 t, 2 hh, 4 words (s)]: 4 value words from each of the pages t and t + 4."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0]],
        lane_bases=[[0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0]],
        warp_bases=[[1, 0, 0, 0, 0], [2, 0, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 2, 4])


@gluon.constexpr_function
def _val_bytes_layout():
    """[4 w, 8 g, 4 t, 2 hh, 4 s, 4 b]."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 2], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 2, 0], [0, 0, 0, 1, 0, 0]],
        lane_bases=[[0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 4, 0, 0, 0, 0]],
        warp_bases=[[1, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 2, 4, 4])


@gluon.constexpr_function
def _row_load_layout():
    """[4 w, 8 g, 2 jw]: the fp16 pairs (tokens 4 q + 2 jw, + 1 of one page) of thread (w, g)'s 4 score rows."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1]],
        lane_bases=[[0, 0, 0], [0, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 8, 2])


@gluon.constexpr_function
def _warp_max_layout(NH):
    cols = [[0, 1]] + [[0, 8 << i] for i in range((NH // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0]] + cols,
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, NH])


# ------------------------------------------------------------------ pieces
@gluon.jit
def _mask4(x):
    """int32 words broadcast over a last dim of 4 (byte b) -> the 4 masked bit-pair planes (int8, byte b)."""
    return gl.inline_asm_elementwise(MASK4, "=r,=r,=r,=r,r,r,r,r", [x],
                                     dtype=(gl.int8, gl.int8, gl.int8, gl.int8), is_pure=True, pack=4)


@gluon.jit
def _ex2(x):
    return gl.inline_asm_elementwise(EX2, "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _lg2(x):
    return gl.inline_asm_elementwise(LG2, "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _rcp(x):
    return gl.inline_asm_elementwise(RCP, "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _key_operands(kb, NH: gl.constexpr):
    """[4 w, 8 g, 4 t, 8] key words -> 4 A operands [128 rows, 32 K] (one per k32 step s)."""
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma8(NH), k_width=4)
    BL: gl.constexpr = _key_bytes_layout()
    x = gl.convert_layout(gl.reshape(kb, [4, 8, 4, 4, 2]), gl.SliceLayout(5, BL), assert_trivial=True)
    x = gl.expand_dims(x, 5) + gl.zeros([4, 8, 4, 4, 2, 4], gl.int32, layout=BL)  # w g t s hh b (broadcast)
    o = _mask4(x)
    c = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))  # [w g t s hh b j0 j1]
    c = gl.permute(c, (7, 0, 6, 1, 4, 2, 5, 3))  # [j1 w j0 g hh t b s]
    c = gl.reshape(c, [128, 32, 2, 2])  # s -> (s1, s0)
    e0, e1 = gl.split(c)  # s0 = 0 / 1
    a0, a2 = gl.split(e0)
    a1, a3 = gl.split(e1)
    return (gl.convert_layout(a0, op, assert_trivial=True), gl.convert_layout(a1, op, assert_trivial=True),
            gl.convert_layout(a2, op, assert_trivial=True), gl.convert_layout(a3, op, assert_trivial=True))


@gluon.jit
def _value_operand(vb, NH: gl.constexpr):
    """[4 w, 8 g, 4 t, 2 hh, 4 s] value words -> A operand [128 channels, 128 K]."""
    op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma8(NH), k_width=4)
    BL: gl.constexpr = _val_bytes_layout()
    x = gl.convert_layout(vb, gl.SliceLayout(5, BL), assert_trivial=True)
    x = gl.expand_dims(x, 5) + gl.zeros([4, 8, 4, 2, 4, 4], gl.int32, layout=BL)  # w g t hh s b (broadcast)
    o = _mask4(x)
    c = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))  # [w g t hh s b j0 j1]
    c = gl.permute(c, (7, 0, 6, 1, 4, 3, 2, 5))  # [j1 w j0 g s hh t b]
    c = gl.reshape(c, [128, 128])
    return gl.convert_layout(c, op, assert_trivial=True)


@gluon.jit
def _rows(x, NH: gl.constexpr):
    """[4 w, 8 g, 2 jw] int32 (fp16 pairs) -> [128] fp32 score rows m = 64 j1 + 16 w + 8 j0 + g
    (SliceLayout(1, mma)); token row j = 2 jw + (0, 1) = 2 j1 + j0."""
    lo, hi = gl.inline_asm_elementwise(HALF2, "=f,=f,r", [x], dtype=(gl.float32, gl.float32), is_pure=True, pack=1)
    x = gl.permute(gl.join(lo, hi), (2, 0, 3, 1))  # [w g j1 j0] -> [j1 w j0 g]
    return gl.convert_layout(gl.reshape(x, [128]), gl.SliceLayout(1, _mma8(NH)), assert_trivial=True)


@gluon.jit
def _thread_rows_sum(x, NH: gl.constexpr):
    """[128, NH] -> [4 w, 8 g, NH]: sum over the thread's own 4 rows (registers only)."""
    y = gl.reshape(x, [2, 4, 2, 8, NH])
    return gl.sum(gl.sum(y, axis=2), axis=0)


@gluon.jit
def _tile_max128(s, red_smem, NH: gl.constexpr):
    x = gl.max(gl.max(gl.reshape(s, [2, 4, 16, NH]), axis=0), axis=1)  # [4 warps, NH]
    red_smem.store(x)
    m = gl.max(red_smem.load(_warp_max_layout(NH)), axis=0)
    return gl.convert_layout(m, gl.SliceLayout(0, _mma8(NH)), assert_trivial=True)


@gluon.jit
def _q_group(q_row, sqh, GI: gl.constexpr, G_Q: gl.constexpr, NH: gl.constexpr, DUP: gl.constexpr):
    """Channels 32 GI .. + 32 of the program's query heads; DUP: rows G_Q .. 2 G_Q - 1 repeat the heads
    (the padding columns of N = 8 then carry the low halves of the query or of P')."""
    ql: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [4, 1], [1, 0])
    h = gl.arange(0, NH, layout=gl.SliceLayout(1, ql))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, ql))
    if DUP:
        hq = gl.where(h < G_Q, h, h - G_Q)
    else:
        hq = h
    x = gl.load(q_row + gl.expand_dims(hq * sqh, 1) + gl.expand_dims(32 * GI + c, 0),
                mask=gl.expand_dims(hq < G_Q, 1), other=0.0).to(gl.float32)
    return x, gl.max(gl.maximum(x, -x), axis=1), h


@gluon.jit
def _round_i(x):
    return (x + gl.where(x >= 0.0, 0.5, -0.5)).to(gl.int32)


@gluon.jit
def _q_store(x, amax, rows, unit, base, q_smem, G_Q: gl.constexpr, QLO: gl.constexpr):
    """int8 codes of one 32-channel group into q_smem; -> (multiplier m_g, m_g * sum(qi)) [NH] int32.
    QLO: rows >= G_Q hold round(128 (q / sq - qi)), the query's low half (same multiplier)."""
    m = gl.minimum((amax / unit).to(gl.int32) + 1, 512)
    xs = x / gl.expand_dims(base * m.to(gl.float32), 1)
    qi = gl.minimum(gl.maximum(_round_i(xs), -127), 127)
    if QLO:
        lo = gl.minimum(gl.maximum(_round_i(128.0 * (xs - qi.to(gl.float32))), -127), 127)
        qi = gl.where(gl.expand_dims(rows >= G_Q, 1), lo, qi)
    q_smem.store(qi.to(gl.int8))
    return m, m * gl.sum(qi, axis=1)


@gluon.jit
def _partner(x):
    """x[:, c ^ NH/2]: columns c and c + 4 of N = 8 sit in lanes t and t ^ 2, same register."""
    return gl.inline_asm_elementwise(SHFL2, "=f,f", [x], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _pages(n0, hi, qt_row):
    """Page ids of the step at n0 (pages past hi: page 0): keys / scales [4 w, 8 g] (page 2 w + g >> 2),
    values [4 t, 2 hh] (page t + 4 hh)."""
    KL: gl.constexpr = _key_load_layout()
    VL: gl.constexpr = _val_load_layout()
    pg0 = n0 // 16
    K2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, KL))
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, K2))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, K2))
    pi = gl.expand_dims(2 * w, 1) + gl.expand_dims(g >> 2, 0)
    page = gl.load(qt_row + pg0 + pi, mask=n0 + 16 * pi < hi, other=0)
    VT: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(4, VL)))
    tv = gl.arange(0, 4, layout=gl.SliceLayout(1, VT))
    hh = gl.arange(0, 2, layout=gl.SliceLayout(0, VT))
    piv = gl.expand_dims(tv, 1) + gl.expand_dims(4 * hh, 0)
    pagev = gl.load(qt_row + pg0 + piv, mask=n0 + 16 * piv < hi, other=0)
    return page, pagev


@gluon.jit
def _load_codes(page, pagev, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, H_KV: gl.constexpr):
    """Codes, scales and zeros of one step from its page ids (_pages)."""
    KL: gl.constexpr = _key_load_layout()
    VL: gl.constexpr = _val_load_layout()
    RL: gl.constexpr = _row_load_layout()
    K2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, KL))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, K2))
    kbase = (page.to(gl.int64) * H_KV + kvh) * 128 + gl.expand_dims(32 * (g & 3), 0)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, KL))))
    byt = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, KL))))
    koff = (gl.expand_dims(gl.expand_dims(kbase, 2), 3)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(8 * t, 0), 0), 3)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(byt, 0), 0), 0))
    kb = gl.load(kc_ptr + koff)
    vbase = (pagev.to(gl.int64) * H_KV + kvh) * 128
    V2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, VL)))
    wv = gl.arange(0, 4, layout=gl.SliceLayout(1, V2))
    gv = gl.arange(0, 8, layout=gl.SliceLayout(0, V2))
    wg = gl.expand_dims(32 * wv, 1) + gl.expand_dims(4 * gv, 0)
    bv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, VL)))))
    voff = (gl.expand_dims(gl.expand_dims(gl.expand_dims(vbase, 0), 1), 4)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(wg, 2), 3), 4)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(bv, 0), 0), 0), 0))
    vb = gl.load(vc_ptr + voff)
    R2: gl.constexpr = gl.SliceLayout(2, RL)
    gr = gl.arange(0, 8, layout=gl.SliceLayout(0, R2))
    pager = gl.convert_layout(page, R2, assert_trivial=True)
    rbase = (pager.to(gl.int64) * H_KV + kvh) * 8 + gl.expand_dims(2 * (gr & 3), 0)
    jr = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, RL)))
    roff = gl.expand_dims(rbase, 2) + gl.expand_dims(gl.expand_dims(jr, 0), 0)
    ks = gl.load(ks_ptr + roff)
    kz = gl.load(kz_ptr + roff)
    vs = gl.load(vs_ptr + roff)
    vz = gl.load(vz_ptr + roff)
    return kb, vb, ks, kz, vs, vz


@gluon.jit
def _load_step(n0, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, H_KV: gl.constexpr):
    """Codes, scales and zeros of the 128-token step at history index n0 (pages past hi read page 0)."""
    page, pagev = _pages(n0, hi, qt_row)
    return _load_codes(page, pagev, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, H_KV)


# ------------------------------------------------------------------ cp.async stages (STAGES > 0)
# A stage holds one step: key words [4 w, 8 g, 4 t, 8] (= 8 pages x 128 words, page 2 w + g >> 2),
# value words [2 hh, 4 t, 4 w, 8 g, 4 s] (page 4 hh + t) and per array the scale words [4 w, 8 g, 2 jw].
# Every thread copies from one page per array kind (one page lookup each), 16 B per cp.async.
@gluon.constexpr_function
def _row_major(rank):
    return gl.SwizzledSharedLayout(1, 1, 1, order=list(range(rank - 1, -1, -1)))


@gluon.constexpr_function
def _key_copy_layout():
    """[4 w, 8 g, 4 t, 8 words]: thread (w, lane = t + 4 q + 16 g2) copies the 8 words of row-quad g."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1, 0, 0, 0], [2, 0, 0, 0]], block_bases=[], shape=[4, 8, 4, 8])


@gluon.constexpr_function
def _val_copy_layout():
    """[2 hh, 4 t, 4 w, 8 g, 4 s]: a thread copies 8 words (g, g + 1) of page 4 hh + t."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0]],
        lane_bases=[[0, 0, 0, 2, 0], [0, 0, 0, 4, 0], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 1, 0, 0, 0]],
        warp_bases=[[0, 2, 0, 0, 0], [1, 0, 0, 0, 0]], block_bases=[], shape=[2, 4, 4, 8, 4])


@gluon.constexpr_function
def _scale_copy_layout():
    """[4 w, 8 g, 2 jw] words of one scale array: 16 B per thread, lanes 16.. and warps 1.. replicate."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 1, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [0, 0, 0]],
        warp_bases=[[0, 0, 0], [0, 0, 0]], block_bases=[], shape=[4, 8, 2])


@gluon.jit
def _copy_step_v2(kst, vst, sst, stage, n0, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr,
                  H_KV: gl.constexpr):
    """Start the copies of the step at n0 into stage (pages past hi: page 0, never read unmasked); one group."""
    pg0 = n0 // 16
    # keys
    CK: gl.constexpr = _key_copy_layout()
    K2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, CK))
    w = gl.arange(0, 4, layout=gl.SliceLayout(1, K2))
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, K2))
    pi = gl.expand_dims(2 * w, 1) + gl.expand_dims(g >> 2, 0)
    page = gl.load(qt_row + pg0 + pi, mask=n0 + 16 * pi < hi, other=0)
    kbase = (page.to(gl.int64) * H_KV + kvh) * 128 + gl.expand_dims(32 * (g & 3), 0)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, CK))))
    wd = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, CK))))
    koff = (gl.expand_dims(gl.expand_dims(kbase, 2), 3)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(8 * t, 0), 0), 3)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(wd, 0), 0), 0))
    async_copy(kst.index(stage), kc_ptr + koff)
    # values
    CV: gl.constexpr = _val_copy_layout()
    V2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, CV)))  # [2 hh, 4 t]
    hh = gl.arange(0, 2, layout=gl.SliceLayout(1, V2))
    tv = gl.arange(0, 4, layout=gl.SliceLayout(0, V2))
    piv = gl.expand_dims(4 * hh, 1) + gl.expand_dims(tv, 0)
    pagev = gl.load(qt_row + pg0 + piv, mask=n0 + 16 * piv < hi, other=0)
    vbase = (pagev.to(gl.int64) * H_KV + kvh) * 128
    W2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(4, CV)))  # [4 w, 8 g]
    wv = gl.arange(0, 4, layout=gl.SliceLayout(1, W2))
    gv = gl.arange(0, 8, layout=gl.SliceLayout(0, W2))
    wg = gl.expand_dims(32 * wv, 1) + gl.expand_dims(4 * gv, 0)
    sv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, CV)))))
    voff = (gl.expand_dims(gl.expand_dims(gl.expand_dims(vbase, 2), 3), 4)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(wg, 0), 0), 4)
            + gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(sv, 0), 0), 0), 0))
    async_copy(vst.index(stage), vc_ptr + voff)
    # scales / zeros
    CS: gl.constexpr = _scale_copy_layout()
    S2: gl.constexpr = gl.SliceLayout(2, CS)
    wr = gl.arange(0, 4, layout=gl.SliceLayout(1, S2))
    gr = gl.arange(0, 8, layout=gl.SliceLayout(0, S2))
    pir = gl.expand_dims(2 * wr, 1) + gl.expand_dims(gr >> 2, 0)
    pager = gl.load(qt_row + pg0 + pir, mask=n0 + 16 * pir < hi, other=0)
    rbase = (pager.to(gl.int64) * H_KV + kvh) * 8 + gl.expand_dims(2 * (gr & 3), 0)
    jr = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, CS)))
    roff = gl.expand_dims(rbase, 2) + gl.expand_dims(gl.expand_dims(jr, 0), 0)
    async_copy(sst[0].index(stage), ks_ptr + roff)
    async_copy(sst[1].index(stage), kz_ptr + roff)
    async_copy(sst[2].index(stage), vs_ptr + roff)
    async_copy(sst[3].index(stage), vz_ptr + roff)
    commit_group()


@gluon.jit
def _read_step_v2(kst, vst, sst, stage):
    kb = kst.index(stage).load(_key_load_layout())
    vb = vst.index(stage).permute((2, 3, 1, 0, 4)).load(_val_load_layout())
    RL: gl.constexpr = _row_load_layout()
    ks = sst[0].index(stage).load(RL)
    kz = sst[1].index(stage).load(RL)
    vs = sst[2].index(stage).load(RL)
    vz = sst[3].index(stage).load(RL)
    return kb, vb, ks, kz, vs, vz


@gluon.jit
def _history_v2(q_row, sqh, qt_row, kvh, lo, hi, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                q_s0, q_s1, q_s2, q_s3, p_smem, red_smem, qk_scale, H_KV: gl.constexpr,
                G_Q: gl.constexpr, NH: gl.constexpr, QLO: gl.constexpr, PLO: gl.constexpr, LATE_V: gl.constexpr,
                STAGES: gl.constexpr, RUNMAX: gl.constexpr, PAGE_AHEAD: gl.constexpr):
    """History tokens [lo, hi) (lo multiple of 128): (O^T [128, NH] unnormalised, m, l)."""
    mma: gl.constexpr = _mma8(NH)
    colL: gl.constexpr = gl.SliceLayout(0, mma)
    rowL: gl.constexpr = gl.SliceLayout(1, mma)
    # ---- the query: int8, one integer multiplier per 32-channel group
    DUP: gl.constexpr = QLO or PLO
    x0, am0, rows = _q_group(q_row, sqh, 0, G_Q, NH, DUP)
    x1, am1, rows = _q_group(q_row, sqh, 1, G_Q, NH, DUP)
    x2, am2, rows = _q_group(q_row, sqh, 2, G_Q, NH, DUP)
    x3, am3, rows = _q_group(q_row, sqh, 3, G_Q, NH, DUP)
    amax = gl.maximum(gl.max(gl.maximum(gl.maximum(am0, am1), gl.maximum(am2, am3)), axis=0), 1e-30)
    unit = amax / 512.0
    base = amax / (127.0 * 512.0)
    m0, qs0 = _q_store(x0, am0, rows, unit, base, q_s0, G_Q, QLO)
    m1, qs1 = _q_store(x1, am1, rows, unit, base, q_s1, G_Q, QLO)
    m2, qs2 = _q_store(x2, am2, rows, unit, base, q_s2, G_Q, QLO)
    m3, qs3 = _q_store(x3, am3, rows, unit, base, q_s3, G_Q, QLO)
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
    is_lo = gl.expand_dims(colv >= G_Q, 0)
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
    if STAGES > 0:
        kst = gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 4, 8], _row_major(4))
        vst = gl.allocate_shared_memory(gl.int32, [STAGES, 2, 4, 4, 8, 4], _row_major(5))
        sst = (gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 2], _row_major(3)),
               gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 2], _row_major(3)),
               gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 2], _row_major(3)),
               gl.allocate_shared_memory(gl.int32, [STAGES, 4, 8, 2], _row_major(3)))
        for j in gl.static_range(STAGES - 1):
            _copy_step_v2(kst, vst, sst, j, lo + j * STEP, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr,
                          vz_ptr, H_KV)
    else:
        kb, vb, ks, kz, vs, vz = _load_step(lo, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, H_KV)
        if PAGE_AHEAD:  # the next step's page ids in registers: its code loads never wait on a lookup
            pg_k, pg_v = _pages(lo + STEP, hi, qt_row)
    step = 0
    for n0 in range(lo, hi, STEP):
        if STAGES > 0:
            wait_group(STAGES - 2)  # this step's copies (this thread's) are done ...
            thread_barrier()  # ... everyone's, and everyone has read the stage refilled below
            kb, vb, ks, kz, vs, vz = _read_step_v2(kst, vst, sst, step % STAGES)
            _copy_step_v2(kst, vst, sst, (step + STAGES - 1) % STAGES, n0 + (STAGES - 1) * STEP, hi, qt_row, kvh,
                          kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, H_KV)
            step += 1
        elif PAGE_AHEAD:
            kb_n, vb_n, ks_n, kz_n, vs_n, vz_n = _load_codes(pg_k, pg_v, kvh, kc_ptr, vc_ptr, ks_ptr, kz_ptr, vs_ptr,
                                                             vz_ptr, H_KV)
            pg_k, pg_v = _pages(n0 + 2 * STEP, hi, qt_row)
        else:
            # next step's loads in flight during this step's math
            kb_n, vb_n, ks_n, kz_n, vs_n, vz_n = _load_step(n0 + STEP, hi, qt_row, kvh, kc_ptr, vc_ptr, ks_ptr,
                                                            kz_ptr, vs_ptr, vz_ptr, H_KV)
        ka0, ka1, ka2, ka3 = _key_operands(kb, NH)
        acc0 = warpgroup_mma(ka0, q_s0.permute((1, 0)), zi, use_acc=False, is_async=True)
        acc1 = warpgroup_mma(ka1, q_s1.permute((1, 0)), zi, use_acc=False, is_async=True)
        acc2 = warpgroup_mma(ka2, q_s2.permute((1, 0)), zi, use_acc=False, is_async=True)
        acc3 = warpgroup_mma(ka3, q_s3.permute((1, 0)), zi, use_acc=False, is_async=True)
        if not LATE_V:
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
        X = (acc0 * m0 + acc1 * m1 + acc2 * m2 + acc3 * m3).to(gl.float32)
        if QLO:
            y = X + zz_t * QSr
            s = a_t * (_partner(y) * wp + y * wq) + lv_t
        else:
            s = a_t * (X + zz_t * QSr) + lv_t  # s' = score (log2 units) + log2 s_v
        m_step = gl.maximum(_tile_max128(s, red_smem, NH), NEG_INIT)
        m_new = gl.maximum(m_i, m_step)
        alpha = _ex2(m_i - m_new)
        m_i = m_new
        if RUNMAX:  # P s_v relative to the running max (PLO keeps 15 bits of it): no per-step beta
            pp = _ex2(s - gl.expand_dims(m_new, 0))
        else:
            beta = _ex2(m_step - m_new)
            pp = _ex2(s - gl.expand_dims(m_step, 0))  # P s_v relative to the step max, in [0, 1]
        pf = pp * 127.0 + MAGIC
        if PLO:
            pfl = pp  # (the weights hi + lo / 128 equal 127 pp within 1 / 256; the 127 is applied at the end)
            pf = pp * p_s + ((pf - MAGIC) * p_t + MAGIC)
        else:
            pfl = pf - MAGIC
        pint = pf.to(gl.int32, bitcast=True).to(gl.int8)
        # P'^T into shared memory, K = bit permutation of the row m (see module doc)
        pk = gl.permute(gl.reshape(pint, [2, 2, 2, 2, 2, 2, 2, NH]), (5, 6, 1, 2, 4, 0, 3, 7))
        p_smem.store(gl.permute(gl.reshape(pk, [128, NH]), (1, 0)))
        fence_async_shared()
        if LATE_V:  # the value A operand built here: 8 word registers live through the softmax, not 32
            a_v = _value_operand(vb, NH)
        acc_v = warpgroup_mma(a_v, p_smem.permute((1, 0)), zi, use_acc=False, is_async=True)
        # softmax sum and zero terms, per thread over its 4 rows (reduced once at the end)
        ls = _thread_rows_sum(pp * ivs_t, NH)
        ps = _thread_rows_sum(pfl, NH)
        zs = _thread_rows_sum(pfl * vz_t, NH)
        al3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(alpha, c3), 0), 0)
        if RUNMAX:
            l_acc = l_acc * al3 + ls
            ps_acc = ps_acc * al3 + ps
            zs_acc = zs_acc * al3 + zs
            acc_v = warpgroup_mma_wait(num_outstanding=0, deps=(acc_v,))
            o = o * gl.expand_dims(alpha, 0) + acc_v.to(gl.float32)
        else:
            be3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(beta, c3), 0), 0)
            l_acc = l_acc * al3 + be3 * ls
            ps_acc = ps_acc * al3 + be3 * ps
            zs_acc = zs_acc * al3 + be3 * zs
            acc_v = warpgroup_mma_wait(num_outstanding=0, deps=(acc_v,))
            o = o * gl.expand_dims(alpha, 0) + gl.expand_dims(beta, 0) * acc_v.to(gl.float32)
        if STAGES == 0:
            kb, vb, ks, kz, vs, vz = kb_n, vb_n, ks_n, kz_n, vs_n, vz_n
    if STAGES > 0:
        wait_group(0)  # no copy outlives the program
    l = gl.convert_layout(gl.sum(gl.sum(l_acc, axis=0), axis=0), colL)
    ps_t = gl.expand_dims(gl.convert_layout(gl.sum(gl.sum(ps_acc, axis=0), axis=0), colL), 0)
    zs_t = gl.expand_dims(gl.convert_layout(gl.sum(gl.sum(zs_acc, axis=0), axis=0), colL), 0)
    if PLO:
        o = _partner(o) * wp + o * wq
        ps_t = ps_t * 127.0
        zs_t = zs_t * 127.0
    o = (o * vpow + vmul * ps_t - zs_t) * (1.0 / 127.0)
    return o, m_i, l


@gluon.jit
def _decode_v2_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, lens_ptr, hist_ptr, wt_ptr, qt_ptr,
    kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    po_ptr, pl_ptr, qk_scale, B, nsplit, nwin,
    sqn, sqh, skn, skh, svn, svh, stride_wt, stride_qt,
    H_KV: gl.constexpr, G_Q: gl.constexpr, NH: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
    SINK: gl.constexpr, RECENT: gl.constexpr, HAS_HIST: gl.constexpr, QLO: gl.constexpr, PLO: gl.constexpr,
    LATE_V: gl.constexpr = False, STAGES: gl.constexpr = 0, RUNMAX: gl.constexpr = False,
    PAGE_AHEAD: gl.constexpr = False,
):
    mma: gl.constexpr = _mma_layout(NH)
    n = gl.program_id(0)
    kvh = gl.program_id(1)
    sid = gl.program_id(2)
    i = _seq_of_token(cu_ptr, n, B)
    start = gl.load(cu_ptr + i)
    t = n - start
    L = gl.load(lens_ptr + i)
    if HAS_HIST:
        n_hist = gl.load(hist_ptr + i)
    else:
        n_hist = gl.maximum(L - SINK - RECENT, 0)
    q_row = q_ptr + n.to(gl.int64) * sqn + kvh * G_Q * sqh
    ns = nsplit + nwin
    head = gl.arange(0, NH, layout=gl.SliceLayout(0, mma))
    prow = (n.to(gl.int64) * (H_KV * G_Q) + kvh * G_Q + head) * ns + sid
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
        chunk = ((n_hist + nsplit - 1) // nsplit + STEP - 1) // STEP * STEP
        lo = gl.minimum(sid * chunk, n_hist)
        hi = gl.minimum(lo + chunk, n_hist)
        o8, m_i, l = _history_v2(q_row, sqh, qt_ptr + i.to(gl.int64) * stride_qt, kvh, lo, hi,
                                 kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, q_s0, q_s1, q_s2, q_s3, p8,
                                 red_smem, qk_scale, H_KV, G_Q, NH, QLO, PLO, LATE_V, STAGES, RUNMAX,
                                 PAGE_AHEAD)
        o = gl.convert_layout(o8, mma)
        m_i = gl.convert_layout(m_i, gl.SliceLayout(0, mma))
        l = gl.convert_layout(l, gl.SliceLayout(0, mma))
    else:
        o, m_i, l = _window_part(q_row, sqh, wt_ptr + i.to(gl.int64) * stride_wt, kvh, sid - nsplit, nwin,
                                 L, n_hist, t, kwin_ptr, vwin_ptr, k_ptr + (start.to(gl.int64) * skn + kvh * skh),
                                 v_ptr + (start.to(gl.int64) * svn + kvh * svh), skn, svn, q_smem_w, kv_smem,
                                 p_smem_w, red_smem, qk_scale, H_KV, G_Q, NH, D, P, SINK, RECENT)
    inv_l = gl.where(l > 0.0, 1.0 / l, 0.0)
    o = o * gl.expand_dims(inv_l, 0)
    gl.store(po_ptr + gl.expand_dims(prow * D, 0) + gl.expand_dims(m_rows, 1), o,
             mask=gl.expand_dims(hok, 0) & gl.expand_dims(m_rows >= 0, 1))
    lse = gl.where(l > 0.0, m_i + gl.log2(l), float("-inf"))
    gl.store(pl_ptr + prow, lse, mask=hok)


# ------------------------------------------------------------------ host side
MAXNREG = 128
WINDOW_TILE_COST = 4  # one 64-token BF16 window tile against 128-token INT2 steps (a guess, not swept)


def plan_v2(N, H_kv, max_hist, sink, recent, device, progs_per_sm=4):
    from oscar_compile.kernels.device import num_sms

    if max_hist <= 2 * STEP_TOKENS:
        return 1, 1
    slots = progs_per_sm * num_sms(device)
    per_split = N * H_kv
    steps = triton.cdiv(max_hist, STEP_TOKENS)
    fit = max(1, slots // per_split)
    nsplit = min(fit, max(1, steps // 2))
    precision = triton.cdiv(max_hist, MAX_SPLIT_TOKENS)
    if precision > nsplit:
        nsplit = triton.cdiv(precision, fit) * fit
    nsplit = triton.cdiv(steps, triton.cdiv(steps, nsplit))
    split_steps = triton.cdiv(steps, nsplit)
    nwin = plan_window_splits(triton.cdiv(sink + recent, 64) + 1, max(1, split_steps // WINDOW_TILE_COST))
    return nsplit, nwin


def _i32(x):
    """A contiguous pool as int32 words (4 code bytes or 2 fp16 per word)."""
    return x.reshape(x.shape[0], x.shape[1], -1).view(torch.int32)


def attention_v2(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win,
                 k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, sink, recent, bits=2,
                 group_size=128, history_lens=None, nsplit=None, win_splits=None, maxnreg=MAXNREG,
                 progs_per_sm=None, qlo=False, plo=False, late_v=False, stages=0, runmax=False,
                 page_ahead=False):
    """Same contract as attention_gluon, but k_codes / v_codes in the masked-in-place v2 format."""
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    B = cache_lens.shape[0]
    P = k_win.shape[2]
    assert bits == 2 and D == 128 and group_size == 128 and P == 16 and H_q // H_kv <= 8
    out = attention_output_for(q, k, v, (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero),
                               history_lens, B)
    if N == 0:
        return out
    g = H_q // H_kv
    if progs_per_sm is None:  # register-limited (shared memory allows 5 at 21.7 KB + 1 KB reserved each... and 10)
        progs_per_sm = min(65536 // (maxnreg * 128), 8)
    planned = plan_v2(N, H_kv, quant_table.shape[1] * P, sink, recent, q.device, progs_per_sm)
    nsplit = planned[0] if nsplit is None else nsplit
    nwin = planned[1] if win_splits is None else win_splits
    ns = nsplit + nwin
    po = torch.empty(N * H_q * ns, D, dtype=torch.float32, device=q.device)
    pl = torch.empty(N * H_q * ns, dtype=torch.float32, device=q.device)
    _decode_v2_kernel[(N, H_kv, ns)](
        q, k, v, cu_seqlens, cache_lens, history_lens if history_lens is not None else cache_lens,
        window_table, quant_table, k_win, v_win, _i32(k_codes), _i32(k_scale), _i32(k_zero), _i32(v_codes),
        _i32(v_scale), _i32(v_zero), po, pl, scale * LOG2E, B, nsplit, nwin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        window_table.stride(0), quant_table.stride(0),
        H_KV=H_kv, G_Q=g, NH=8, D=D, P=P, SINK=sink, RECENT=recent,
        HAS_HIST=history_lens is not None, QLO=qlo and 2 * g == 8, PLO=plo and 2 * g == 8, LATE_V=late_v, STAGES=stages, RUNMAX=runmax and plo, PAGE_AHEAD=page_ahead,
        num_warps=4,
        maxnreg=maxnreg,
    )
    merge_partials(po, pl, out, ns)
    return out


def compile_offline(num_q_per_kv=4, num_kv_heads=8, sink=64, recent=256, window_dtype="bf16",
                    has_hist=False, maxnreg=MAXNREG, qlo=False, plo=False, late_v=False, stages=0, runmax=False,
                    page_ahead=False):
    from triton.backends.compiler import GPUTarget

    from oscar_compile.kernels.gluon_compat import gluon_ast_source

    ptrs = {"q_ptr": window_dtype, "k_ptr": window_dtype, "v_ptr": window_dtype, "cu_ptr": "i32",
            "lens_ptr": "i32", "hist_ptr": "i32", "wt_ptr": "i32", "qt_ptr": "i32",
            "kwin_ptr": window_dtype, "vwin_ptr": window_dtype, "kc_ptr": "i32", "ks_ptr": "i32",
            "kz_ptr": "i32", "vc_ptr": "i32", "vs_ptr": "i32", "vz_ptr": "i32",
            "po_ptr": "fp32", "pl_ptr": "fp32"}
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig.update({"qk_scale": "fp32", **{n: "i32" for n in (
        "B", "nsplit", "nwin", "sqn", "sqh", "skn", "skh", "svn", "svh", "stride_wt", "stride_qt")}})
    consts = {"H_KV": num_kv_heads, "G_Q": num_q_per_kv, "NH": 8, "D": 128, "P": 16, "SINK": sink,
              "RECENT": recent, "HAS_HIST": has_hist, "QLO": qlo, "PLO": plo,
              "LATE_V": late_v, "STAGES": stages, "RUNMAX": runmax, "PAGE_AHEAD": page_ahead}
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in (*range(len(ptrs)), *range(len(ptrs) + 4, len(ptrs) + 12))}
    src = gluon_ast_source()(_decode_v2_kernel, sig, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
