"""Register-level pieces of the Gluon decode kernel (attention_gluon.py): layouts that are the
wgmma fragments, the decode of 2-bit codes into them, and the loads of one 64-token history step.

Each layout is written as a linear layout, so that a thread's loads are its share of the A
fragment and ``convert_layout(..., assert_trivial=True)`` moves no data (docs/cache-format.md,
"How the fp16-operand Hopper kernel reads the planar rows").
"""
from __future__ import annotations

from oscar_compile.kernels.gluon_compat import async_copy, commit_group, gl, gluon

TILE_TOKENS = 64  # tokens per warpgroup step: the wgmma M of the key dot, the K of the value dot
TILE = gl.constexpr(TILE_TOKENS)
NEG_INIT = gl.constexpr(-1.0e30)  # finite: a fully masked step gives alpha = 1, p = 0, never NaN
# Decode of one 32-bit word of b-bit codes into the fp16 values of its 8 / b planes, as
# subnormals c * 2^(b p - 24) (attention_blocks_triton._dequant_asm, all planes at once): two
# byte permutes put bytes (0, 1) and (2, 3) into the low byte of each 16-bit half, one AND per
# plane and half pair keeps a plane's bits. Outputs 4 p .. 4 p + 3 are plane p of bytes 0 .. 3.
def _plane_masks(bits: int) -> str:
    mask = ((1 << bits) - 1) * 0x00010001
    return "".join(f"and.b32 t, lo, {mask << (bits * p):#010x}; mov.b32 {{${4 * p}, ${4 * p + 1}}}, t; "
                   f"and.b32 t, hi, {mask << (bits * p):#010x}; mov.b32 {{${4 * p + 2}, ${4 * p + 3}}}, t; "
                   for p in range(8 // bits))


def _key_word_asm(bits: int) -> str:
    w = 32 // bits  # the input's operand number: after the outputs
    return (f"{{ .reg .b32 lo, hi, t, z; mov.b32 z, 0; prmt.b32 lo, ${w}, z, 0x4140; "
            f"prmt.b32 hi, ${w}, z, 0x4342; " + _plane_masks(bits) + "}")


def _value_bytes_asm(bits: int) -> str:
    """The same from four separate bytes (the value codes of 4 tokens, one byte each, bytes (0, 1)
    then (2, 3) of the word), shifted right by the fifth input first (INT2 at D = 64: the plane
    pair of a warp)."""
    w = 32 // bits
    return (f"{{ .reg .b32 lo, hi, t; prmt.b32 lo, ${w}, ${w + 1}, 0x5410; prmt.b32 hi, ${w + 2}, ${w + 3}, 0x5410; "
            f"shr.b32 lo, lo, ${w + 4}; shr.b32 hi, hi, ${w + 4}; " + _plane_masks(bits) + "}")


KEY_WORD2 = gl.constexpr(_key_word_asm(2))
KEY_WORD4 = gl.constexpr(_key_word_asm(4))
VALUE_BYTES2 = gl.constexpr(_value_bytes_asm(2))
VALUE_BYTES4 = gl.constexpr(_value_bytes_asm(4))


# ------------------------------------------------------------------ layouts (compile-time)
@gluon.constexpr_function
def _mma_layout(NH):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NH, 16])


@gluon.constexpr_function
def _key_words_layout(NW):
    """[4 blocks, 16 rows, NW words]: warp w, lane 4 g + t hold rows g and g + 8 of the tile's
    16-token block w, the words of thread t. Flattened to [64 tokens, NW] it is the A fragment's
    share of each thread (_key_operand); the block axis is the warp, so each thread finds the
    page of one block per step."""
    per = NW // 4
    reg = [[0, 0, 1 << i] for i in range(per.bit_length() - 1)] + [[0, 8, 0]]
    lane = [[0, 0, per], [0, 0, 2 * per], [0, 1, 0], [0, 2, 0], [0, 4, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[[1, 0, 0], [2, 0, 0]],
                                      block_bases=[], shape=[4, 16, NW])


@gluon.constexpr_function
def _value_bytes_layout(WP, X):
    """[X, 4 (v), 4 (t), WP bytes, 2 (b), 2 (e)]: lane 4 g + t of warp w holds the bytes of
    tokens 16 v + 8 b + 2 t + e in byte column g + 8 w (INT2 at D = 128, INT4 at D = 64), in
    columns g + 8 w and g + 8 w + 32 (INT4 at D = 128: WP = 64, two planes per byte), or in
    column g + 8 (w & 1) for plane pair x = w >> 1 (INT2 at D = 64, X = 2: two warps read each
    byte)."""
    reg = [[0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 0], [0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0]]
    if WP == 64:
        reg = reg + [[0, 0, 0, 32, 0, 0]]
    lane = [[0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 0, 0, 1, 0, 0], [0, 0, 0, 2, 0, 0],
            [0, 0, 0, 4, 0, 0]]
    warp = [[0, 0, 0, 8, 0, 0], [0, 0, 0, 16, 0, 0] if X == 1 else [1, 0, 0, 0, 0, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=warp, block_bases=[],
                                      shape=[X, 4, 4, WP, 2, 2])


@gluon.constexpr_function
def _rows_layout(D):
    """[64, D] 16-bit rows, 16 bytes per thread along D (window tiles, the query)."""
    tpr = min(32, D // 8)
    return gl.BlockedLayout([1, 8], [32 // tpr, tpr], [4, 1], [1, 0])


@gluon.constexpr_function
def _vec_layout():
    return gl.BlockedLayout([1], [32], [4], [0])


# ------------------------------------------------------------------ small helpers
@gluon.jit
def _decode_key_words(words, BITS: gl.constexpr):
    """int32 words -> 32 / BITS fp16 tensors (KEY_WORDb's outputs), each in the words' layout."""
    if BITS == 2:  # (one return: Triton checks every return's type, even under a constexpr if)
        o = gl.inline_asm_elementwise(KEY_WORD2, "=h," * 16 + "r", [words], dtype=(gl.float16,) * 16,
                                      is_pure=True, pack=1)
    else:
        o = gl.inline_asm_elementwise(KEY_WORD4, "=h," * 8 + "r", [words], dtype=(gl.float16,) * 8,
                                      is_pure=True, pack=1)
    return o


@gluon.jit
def _decode_value_bytes(x00, x10, x01, x11, shift, BITS: gl.constexpr):
    """Four byte tensors (token offsets e + 8 b: x_eb) -> 32 / BITS fp16 tensors (VALUE_BYTESb)."""
    if BITS == 2:
        o = gl.inline_asm_elementwise(VALUE_BYTES2, "=h," * 16 + "r,r,r,r,r", [x00, x10, x01, x11, shift],
                                      dtype=(gl.float16,) * 16, is_pure=True, pack=1)
    else:
        o = gl.inline_asm_elementwise(VALUE_BYTES4, "=h," * 8 + "r,r,r,r,r", [x00, x10, x01, x11, shift],
                                      dtype=(gl.float16,) * 8, is_pure=True, pack=1)
    return o


@gluon.jit
def _pow2(e):
    """2^e as float32 for integer tensors -126 <= e <= 127, from its bits (exact)."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _kappa_channel(kappa, WP: gl.constexpr):
    """Channel whose code sits at contraction index kappa of the key dot (see module doc)."""
    NMU: gl.constexpr = WP // 16
    e = kappa & 1
    t = (kappa >> 1) & 3
    i0 = (kappa >> 3) & 1
    s = kappa >> 4
    return WP * (s // NMU) + 4 * NMU * t + 4 * (s % NMU) + 2 * i0 + e


@gluon.jit
def _value_channel(m, WP: gl.constexpr, X: gl.constexpr, BITS: gl.constexpr):
    """(channel, bit offset of its decoded code) of row m of the value dot's output
    (m = g + 8 a + 16 w + 64 r): the row holds the code times 2^(offset - 24)."""
    g = m & 7
    a = (m >> 3) & 1
    w = (m >> 4) & 3
    r = m >> 6
    if BITS == 4:  # plane a of byte column g + 8 w + 32 r
        return g + 8 * w + 32 * r + WP * a, 4 * a
    if X == 1:
        return g + 8 * w + WP * (a + 2 * r), 2 * (a + 2 * r)
    # D = 64: plane a + 2 x of byte column g + 8 (w & 1), shifted down by 4 x bits first
    return g + 8 * (w & 1) + WP * (a + 2 * (w >> 1)), 2 * a


@gluon.jit
def _seq_of_token(cu_ptr, n, B):
    """Sequence of flat token n: #{j in [1, B]: cu[j] <= n} (cu non-decreasing, cu[0] = 0)."""
    vec: gl.constexpr = _vec_layout()
    count = n * 0
    for c0 in range(1, B + 1, 128):
        j = c0 + gl.arange(0, 128, layout=vec)
        bound = gl.load(cu_ptr + j, mask=j <= B, other=2147483647)
        count += gl.sum((bound <= n).to(gl.int32), axis=0)
    return count


@gluon.jit
def _token_state(cu_ptr, lens_ptr, hist_ptr, n, B, SINK: gl.constexpr, RECENT: gl.constexpr,
                 HAS_HIST: gl.constexpr):
    """Flat token n's sequence i, the sequence's first new token, its cached length L and its
    history length (given, or the standard max(0, L - S0 - W)): the start of every decode program."""
    i = _seq_of_token(cu_ptr, n, B)
    start = gl.load(cu_ptr + i)
    L = gl.load(lens_ptr + i)
    if HAS_HIST:
        n_hist = gl.load(hist_ptr + i)
    else:
        n_hist = gl.maximum(L - SINK - RECENT, 0)
    return i, start, L, n_hist


@gluon.jit
def _store_partial(po_ptr, pl_ptr, o, m_i, den, prow, chan, hok, m_rows, D: gl.constexpr):
    """A split's normalised partial o [D, NH] (channel rows ``chan``) and its log2-sum-exp (from the
    running max m_i and denominator den), for
    the heads ``hok`` of rows ``prow`` (an empty split: zeros and -inf, which the merge skips)."""
    inv_l = gl.where(den > 0.0, 1.0 / den, 0.0)
    o = o * gl.expand_dims(inv_l, 0)
    gl.store(po_ptr + gl.expand_dims(prow * D, 0) + gl.expand_dims(chan, 1), o,
             mask=gl.expand_dims(hok, 0) & gl.expand_dims(m_rows >= 0, 1))
    lse = gl.where(den > 0.0, m_i + gl.log2(den), float("-inf"))
    gl.store(pl_ptr + prow, lse, mask=hok)


@gluon.jit
def _slot_ok(w, n_sink, n_hist, n_rec, SINK: gl.constexpr, RECENT: gl.constexpr):
    """Window slots that hold a cached token (attention_triton.window_slot_ok, same rule)."""
    ok = w < n_sink
    if RECENT > 0:
        j = (w - SINK + RECENT - n_hist % RECENT) % RECENT
        ok = ok | ((w >= SINK) & (w < SINK + RECENT) & (j < n_rec))
    return ok


@gluon.constexpr_function
def _warp_max_layout(NH):
    """[4 warps, NH]: each thread holds all four warps' entries of its score columns (the mma
    layout's: 2 t, 2 t + 1, then + 8 i), so the max over warps is a register reduction whose
    result is in the mma layout's column slice."""
    cols = [[0, 1]] + [[0, 8 << i] for i in range((NH // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=[[1, 0], [2, 0]] + cols,
                                      lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                      warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, NH])


@gluon.jit
def _tile_max(s, red_smem, NH: gl.constexpr):
    """max over the 64 rows of s [64, NH] (4 warps x 16 rows): shuffles within each warp, then
    one exchange of the four warp maxima through red_smem [4, NH] (one barrier; the generic
    reduction takes two exchanges and three barriers)."""
    mma: gl.constexpr = _mma_layout(NH)
    red_smem.store(gl.max(gl.reshape(s, [4, 16, NH]), axis=1))
    m = gl.max(red_smem.load(_warp_max_layout(NH)), axis=0)
    return gl.convert_layout(m, gl.SliceLayout(0, mma), assert_trivial=True)


@gluon.jit
def _softmax_step(s, m_i, l_part, red_smem, NH: gl.constexpr):
    """Online softmax over the 64 keys (rows) of s: [64, N] (base 2) -> (p, alpha, m, l)."""
    m_new = gl.maximum(m_i, _tile_max(s, red_smem, NH))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 0))
    l_part = l_part * gl.expand_dims(alpha, 0) + p
    return p, alpha, m_new, l_part


# ------------------------------------------------------------------ the INT2 history
# ------------------------------------------------------------------ the INT2 history, through shared memory
# Each 64-token step is copied into one of STAGES shared-memory stages with cp.async, STAGES - 1
# steps ahead of the math, so that enough bytes are in flight to cover the memory latency
# (registers could hold only the step being decoded: a register double buffer cost more
# occupancy than it hid). Warp w copies the tile's 16-token block w: the planar rows of a block
# are contiguous in the pools (pages hold a multiple of 16 tokens), so each thread has one page
# lookup per step, made one step earlier still so that no copy waits for it.
@gluon.constexpr_function
def _key_copy_layout(NW):
    """[4 blocks, 16 rows, NW words]: warp w copies block w, a thread half a row (16 bytes at
    D = 128, 8 at D = 64)."""
    half = NW // 2
    reg = [[0, 0, 1 << i] for i in range(half.bit_length() - 1)]
    lane = [[0, 0, half], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane, warp_bases=[[1, 0, 0], [2, 0, 0]],
                                      block_bases=[], shape=[4, 16, NW])


@gluon.constexpr_function
def _value_copy_layout(WP, X):
    """[X, 4 (v), 4 (t), WP, 2 (b), 2 (e)], token 16 v + 8 b + 2 t + e (the shape of
    _value_bytes_layout): warp v copies block v, a thread 16 bytes of one row (32 for INT4 at
    D = 128; INT2 at D = 64, where a row is 16 bytes, copies each block twice, once per plane
    pair x, from L2)."""
    per = WP * X // 2  # bytes a thread copies: 16, or 32 for INT4 at D = 128
    reg = [[0, 0, 0, 1 << i, 0, 0] for i in range(per.bit_length() - 1)]
    lane = [[0, 0, 0, per, 0, 0] if X == 1 else [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1],
            [0, 0, 1, 0, 0, 0], [0, 0, 2, 0, 0, 0], [0, 0, 0, 0, 1, 0]]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=lane,
                                      warp_bases=[[0, 1, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0]], block_bases=[],
                                      shape=[X, 4, 4, WP, 2, 2])


@gluon.constexpr_function
def _scale_copy_layout():
    """[4 blocks, 16 rows] of one scale / zero array: warp w copies block w, lanes 8 i + j (i < 4)
    rows 2 j, 2 j + 1 (the four lanes of a pair copy the same 4 bytes: one request per warp)."""
    return gl.DistributedLinearLayout(reg_bases=[[0, 1]], lane_bases=[[0, 2], [0, 4], [0, 8], [0, 0], [0, 0]],
                                      warp_bases=[[1, 0], [2, 0]], block_bases=[], shape=[4, 16])


@gluon.constexpr_function
def _row_major(rank):
    return gl.SwizzledSharedLayout(1, 1, 1, order=list(range(rank - 1, -1, -1)))


@gluon.constexpr_function
def _value_stage_layout():
    """One stage's [X, 4 (v), 4 (t), WP, 2 (b), 2 (e)] over row-major [X, 64 tokens, WP]."""
    return gl.SwizzledSharedLayout(1, 1, 1, order=[3, 5, 2, 4, 1, 0])


@gluon.jit
def _allocate_history_stages(kc_ptr, vc_ptr, ks_ptr, STAGES: gl.constexpr, WP: gl.constexpr,
                             X: gl.constexpr):
    """The STAGES shared-memory stages of the history: key words, value bytes, scales / zeros."""
    kbuf = gl.allocate_shared_memory(kc_ptr.dtype.element_ty, [STAGES, 4, 16, WP // 4], _row_major(3))
    vbuf = gl.allocate_shared_memory(vc_ptr.dtype.element_ty, [STAGES, X, 4, 4, WP, 2, 2], _value_stage_layout())
    # key scale, key zero, value scale, value zero of the 4 blocks, one allocation each (copies
    # into one would each get a barrier: Triton's barrier insertion cannot tell them apart)
    sdt: gl.constexpr = ks_ptr.dtype.element_ty
    ksb = gl.allocate_shared_memory(sdt, [STAGES, 4, 16], _row_major(2))
    kzb = gl.allocate_shared_memory(sdt, [STAGES, 4, 16], _row_major(2))
    vsb = gl.allocate_shared_memory(sdt, [STAGES, 4, 16], _row_major(2))
    vzb = gl.allocate_shared_memory(sdt, [STAGES, 4, 16], _row_major(2))
    return kbuf, vbuf, (ksb, kzb, vsb, vzb)


@gluon.jit
def _block_pages(n0, hi, qt_row, P: gl.constexpr, NW: gl.constexpr):
    """(page, block, live) of the block each thread copies in the step at n0: warp w takes block
    w, clamped to the last block below hi so that every address stays inside the pools; a step
    wholly past hi (the pipeline's tail, an empty split) is not live: no lookup, no copy."""
    kl: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _key_copy_layout(NW)))
    blk = gl.minimum(n0 // 16 + gl.arange(0, 4, layout=kl), (hi - 1) // 16)
    live = blk * 0 + n0 < hi  # [4], as the copies' masks want it
    return gl.load(qt_row + blk * 16 // P, mask=live, other=0), blk, live


@gluon.jit
def _copy_step(kbuf, vbuf, sbuf, stage, page, blk, live, kvh, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
               H_KV: gl.constexpr, P: gl.constexpr, WP: gl.constexpr, X: gl.constexpr):
    """Start the copies of one step's blocks (page, blk, live: _block_pages) into stage; one group."""
    NW: gl.constexpr = WP // 4
    kcl: gl.constexpr = _key_copy_layout(NW)
    vcl: gl.constexpr = _value_copy_layout(WP, X)
    scl: gl.constexpr = _scale_copy_layout()
    base = (page.to(gl.int64) * H_KV + kvh) * P + blk * 16 % P  # [4] pool row of block w's first token
    # keys: [4, 16, NW] words
    kr = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, kcl)))
    kcol = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(1, kcl)))
    krow = gl.expand_dims(gl.expand_dims(base, 1) + gl.expand_dims(kr, 0), 2)
    async_copy(kbuf.index(stage), kc_ptr + krow * NW + gl.expand_dims(gl.expand_dims(kcol, 0), 1),
               mask=gl.expand_dims(gl.expand_dims(live, 1), 2))
    # scales and zeros: [4, 16] per array
    sr = gl.arange(0, 16, layout=gl.SliceLayout(0, scl))
    sbase = gl.convert_layout(base, gl.SliceLayout(1, scl), assert_trivial=True)
    slive = gl.expand_dims(gl.convert_layout(live, gl.SliceLayout(1, scl), assert_trivial=True), 1)
    srow = gl.expand_dims(sbase, 1) + gl.expand_dims(sr, 0)
    async_copy(sbuf[0].index(stage), ks_ptr + srow, mask=slive)
    async_copy(sbuf[1].index(stage), kz_ptr + srow, mask=slive)
    async_copy(sbuf[2].index(stage), vs_ptr + srow, mask=slive)
    async_copy(sbuf[3].index(stage), vz_ptr + srow, mask=slive)
    # values: [X, 4, 4, WP, 2, 2] bytes, token 16 v + 8 b + 2 t + e
    s5: gl.constexpr = gl.SliceLayout(5, vcl)
    s4: gl.constexpr = gl.SliceLayout(4, s5)  # [X, 4 (v), 4 (t), WP]
    vbase = gl.convert_layout(base, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, s4))), assert_trivial=True)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, s4))))
    col = gl.arange(0, WP, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, s4))))
    x = gl.arange(0, X, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, s4))))
    bb = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, s5)))))
    ee = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
        3, gl.SliceLayout(4, vcl))))))
    v5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(vbase, 0), 2), 3), 4)  # [1, 4, 1, 1, 1]
    t5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(t, 0), 1), 3), 4)  # [1, 1, 4, 1, 1]
    c5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(col, 0), 1), 2), 4)  # [1, 1, 1, WP, 1]
    x5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(x, 1), 2), 3), 4) * 0  # [X, 1, 1, 1, 1]
    b5 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(bb, 0), 1), 2), 3)  # [1, 1, 1, 1, 2]
    e6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(ee, 0), 1), 2), 3), 4)
    vlive = gl.convert_layout(live, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, s4))), assert_trivial=True)
    vl6 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(vlive, 0), 2), 3), 4), 5)
    async_copy(vbuf.index(stage), vc_ptr + gl.expand_dims((v5 + 2 * t5 + 8 * b5 + x5) * WP + c5, 5) + e6 * WP,
               mask=vl6)
    commit_group()


@gluon.jit
def _read_step(kbuf, vbuf, sbuf, stage, n0, hi, WP: gl.constexpr, X: gl.constexpr, NH: gl.constexpr):
    """One step's codes, scales and zeros from its stage, as the math consumes them: key words
    [64, WP / 4] int32, value bytes [X, 4, 4, WP, 2, 2], and per-token key / value scale and zero
    [64] float32 in the score layout. Rows past hi hold whatever their page held: the step masks
    their scores, and their value scales and zeros are zeroed here."""
    kwl: gl.constexpr = _key_words_layout(WP // 4)
    mma: gl.constexpr = _mma_layout(NH)
    sc: gl.constexpr = gl.SliceLayout(1, mma)
    kw = gl.reshape(kbuf.index(stage).load(kwl), [TILE, WP // 4])
    vb = vbuf.index(stage).load(_value_bytes_layout(WP, X))
    rows: gl.constexpr = gl.SliceLayout(2, kwl)  # [4, 16]: the thread's rows g, g + 8 of block w
    ks = gl.convert_layout(gl.reshape(sbuf[0].index(stage).load(rows), [TILE]), sc, assert_trivial=True)
    kz = gl.convert_layout(gl.reshape(sbuf[1].index(stage).load(rows), [TILE]), sc, assert_trivial=True)
    vs = gl.convert_layout(gl.reshape(sbuf[2].index(stage).load(rows), [TILE]), sc, assert_trivial=True)
    vz = gl.convert_layout(gl.reshape(sbuf[3].index(stage).load(rows), [TILE]), sc, assert_trivial=True)
    ks, kz, vs, vz = ks.to(gl.float32), kz.to(gl.float32), vs.to(gl.float32), vz.to(gl.float32)
    ok = n0 + gl.arange(0, TILE, layout=sc) < hi
    return kw, vb, ks, kz, gl.where(ok, vs, 0.0), gl.where(ok, vz, 0.0), ok


@gluon.jit
def _key_operand(kw, D: gl.constexpr, WP: gl.constexpr, NH: gl.constexpr, BITS: gl.constexpr):
    """Key words [64, WP / 4] -> the wgmma A operand [64, D] in contraction order (no data moves)."""
    mma: gl.constexpr = _mma_layout(NH)
    NMU: gl.constexpr = WP // 16
    o = _decode_key_words(kw, BITS)
    # plane p, byte pair i0 (bytes 2 i0, 2 i0 + 1: e = 0, 1)
    p0 = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))  # [64, NW, e, i0]
    p1 = gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7]))
    if BITS == 2:
        p2 = gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11]))
        p3 = gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15]))
        c = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [64, NW, e, i0, p0, p1]
        c = gl.reshape(c, [TILE, 4, NMU, 2, 2, 2, 2])  # [key, t, mu, e, i0, p0, p1]
        c = gl.permute(c, (0, 6, 5, 2, 4, 1, 3))  # [key, p1, p0, mu, i0, t, e]
    else:
        c = gl.join(p0, p1)  # [64, NW, e, i0, p]
        c = gl.reshape(c, [TILE, 4, NMU, 2, 2, 2])  # [key, t, mu, e, i0, p]
        c = gl.permute(c, (0, 5, 2, 4, 1, 3))  # [key, p, mu, i0, t, e]
    c = gl.reshape(c, [TILE, D])
    return gl.convert_layout(c, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                             assert_trivial=True)


@gluon.jit
def _value_operand(vb, D: gl.constexpr, X: gl.constexpr, NH: gl.constexpr, BITS: gl.constexpr):
    """Value bytes [X, 4, 4, WP, 2 (b), 2 (e)] -> the wgmma A operand [D rows m, 64 tokens]."""
    mma: gl.constexpr = _mma_layout(NH)
    vi = vb.to(gl.int32)
    x_e0, x_e1 = gl.split(vi)  # [X, 4, 4, WP, b]
    x00, x01 = gl.split(x_e0)
    x10, x11 = gl.split(x_e1)
    # plane pair x = warp >> 1 at D = 64: its two planes shifted down to planes 0 and 1
    xs = gl.arange(0, X, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, x00.type.layout))))
    shift = gl.expand_dims(gl.expand_dims(gl.expand_dims(xs, 1), 2), 3) * 4 + x00 * 0
    o = _decode_value_bytes(x00, x10, x01, x11, shift, BITS)
    # plane p, token half b (tokens +8 b), pair e
    q0 = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))  # [X, v, t, WP, e, b]
    q1 = gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7]))
    if BITS == 4:
        c = gl.join(q0, q1)  # [1, v, t, WP, e, b, a]
        if D == 128:  # byte column g + 8 w + 32 r
            c = gl.reshape(c, [4, 4, 2, 4, 8, 2, 2, 2])  # [v, t, r, w, g, e, b, a]
            c = gl.permute(c, (2, 3, 7, 4, 0, 6, 1, 5))  # [r, w, a, g, v, b, t, e]
        else:
            c = gl.reshape(c, [4, 4, 4, 8, 2, 2, 2])  # [v, t, w, g, e, b, a]
            c = gl.permute(c, (2, 6, 3, 0, 5, 1, 4))  # [w, a, g, v, b, t, e]
    elif X == 1:
        q2 = gl.join(gl.join(o[8], o[9]), gl.join(o[10], o[11]))
        q3 = gl.join(gl.join(o[12], o[13]), gl.join(o[14], o[15]))
        c = gl.join(gl.join(q0, q1), gl.join(q2, q3))  # [1, v, t, WP, e, b, a, r]
        c = gl.reshape(c, [4, 4, 4, 8, 2, 2, 2, 2])  # [v, t, w, g, e, b, a, r]
        c = gl.permute(c, (7, 2, 6, 3, 0, 5, 1, 4))  # [r, w, a, g, v, b, t, e]
    else:
        c = gl.join(q0, q1)  # [x, v, t, WP, e, b, a]
        c = gl.reshape(c, [2, 4, 4, 2, 8, 2, 2, 2])  # [x, v, t, w0, g, e, b, a]
        c = gl.permute(c, (0, 3, 7, 4, 1, 6, 2, 5))  # [x, w0, a, g, v, b, t, e]
    c = gl.reshape(c, [D, TILE])
    return gl.convert_layout(c, gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
                             assert_trivial=True)
