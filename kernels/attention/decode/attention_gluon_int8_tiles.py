"""Register-level pieces of the 8-bit-integer Hopper decode (attention_gluon_int8.py): the layouts
that are the fragments of ``wgmma.m64n8k32.s32.s8.s8``, the in-place masks that turn stored code
words into A registers, and the loads of one 128-token history step.

The stored words are the masked code layout (docs/cache-format.md; the byte order of the reference
pack ``kernels/layout/code_layout_ref``): in the 8-bit A fragment thread (warp w, lane 4 g + t) holds rows
r = 16 w + g, r + 8, r + 64, r + 72 and, per k32 block, K columns 4 t .. 4 t + 3 and 16 + 4 t ..
16 + 4 t + 3. A stored 32-bit word holds one K column per byte and those 4 rows in its bit pairs,
so ``word & (0x03030303 << 2 j)`` is an A register (4 codes times 4^j): one LOP3 per 4 codes.
Each layout below is a linear layout whose registers are exactly that share, so the
``convert_layout(..., assert_trivial=True)`` calls move no data.
"""
from __future__ import annotations

from oscar_compile.kernels.gluon_compat import gl, gluon

STEP_TOKENS = 128
STEP = gl.constexpr(STEP_TOKENS)
MAGIC = gl.constexpr(12582912.0)  # 1.5 * 2^23: x + MAGIC holds round(x) in its low mantissa bits
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
def _q_group(q_row, sqh, GI: gl.constexpr, G_Q: gl.constexpr, NH: gl.constexpr):
    """Channels 32 GI .. + 32 of the program's G_Q <= NH / 2 query heads, on rows h and h + NH / 2
    both: the padding columns of N carry the low halves of the query and of P', and a column and
    its low half then sit in lanes t and t ^ 2 of one register (``_partner``)."""
    ql: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [4, 1], [1, 0])
    h = gl.arange(0, NH, layout=gl.SliceLayout(1, ql))
    c = gl.arange(0, 32, layout=gl.SliceLayout(0, ql))
    hq = gl.where(h < NH // 2, h, h - NH // 2)
    x = gl.load(q_row + gl.expand_dims(hq * sqh, 1) + gl.expand_dims(32 * GI + c, 0),
                mask=gl.expand_dims(hq < G_Q, 1), other=0.0).to(gl.float32)
    return x, gl.max(gl.maximum(x, -x), axis=1), h


@gluon.jit
def _round_i(x):
    return (x + gl.where(x >= 0.0, 0.5, -0.5)).to(gl.int32)


@gluon.jit
def _q_store(x, amax, rows, unit, base, q_smem, NH: gl.constexpr):
    """int8 codes of one 32-channel group into q_smem; -> (multiplier m_g, m_g * sum(qi)) [NH] int32.
    Rows >= NH / 2 hold round(128 (q / sq - qi)), the query's low half (same multiplier): with the
    high half a ~15-bit query (an int8 query alone gave 4e-3 to 2.4e-2 error on peaked attention)."""
    m = gl.minimum((amax / unit).to(gl.int32) + 1, 512)
    xs = x / gl.expand_dims(base * m.to(gl.float32), 1)
    qi = gl.minimum(gl.maximum(_round_i(xs), -127), 127)
    lo = gl.minimum(gl.maximum(_round_i(128.0 * (xs - qi.to(gl.float32))), -127), 127)
    qi = gl.where(gl.expand_dims(rows >= NH // 2, 1), lo, qi)
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
