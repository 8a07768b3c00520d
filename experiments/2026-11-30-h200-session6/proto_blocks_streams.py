"""Prototype: decode history block with the padding rows put to work as token streams.

ROWS = G_Q * W query rows; row r is query head r // W of the KV head, reading stream r % W: the
W runs of SUB = BN / W tokens of each block. Keys: one dot per plane with a block-diagonal A
(row r's q plane in the K columns of its stream) against the codes laid out [W * WP, SUB];
the softmax runs on [ROWS, SUB] (no padding rows); values: block-diagonal P [ROWS, BN] against
the usual [BN, WP] codes. The W streams of a head are merged at the end (merge_streams).
"""
import triton
import triton.language as tl
from oscar_compile.kernels.attention_blocks_triton import decode_plane, pick4, softmax_step, _group


@triton.jit
def rows_of(x, G: tl.constexpr, W: tl.constexpr, SUB: tl.constexpr):
    """x: [W * SUB] per token -> [G * W, SUB]: row r holds the tokens of stream r % W."""
    return tl.reshape(tl.broadcast_to(tl.reshape(x, [W, SUB])[None, :, :], [G, W, SUB]), [G * W, SUB])


@triton.jit
def block_diag_q(q, W: tl.constexpr, WP: tl.constexpr, ROWS: tl.constexpr):
    """q: [ROWS, WP] -> [ROWS, W * WP], row r's values in the columns of stream r % W, zeros elsewhere."""
    kk = tl.arange(0, W * WP)
    ws = tl.arange(0, ROWS) % W
    wide = tl.reshape(tl.broadcast_to(q[:, None, :], [ROWS, W, WP]), [ROWS, W * WP])
    return tl.where((kk[None, :] // WP) == ws[:, None], wide, 0.0)


@triton.jit
def _kfix(s, dg, PL: tl.constexpr, WP: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, ks, kz, qg,
          G: tl.constexpr, W: tl.constexpr, SUB: tl.constexpr):
    if ((PL + 1) * WP) % GROUP == 0:
        g: tl.constexpr = (PL * WP) // GROUP
        sc = rows_of(_group(ks, g, NG), G, W, SUB)
        zr = rows_of(_group(kz, g, NG), G, W, SUB)
        s = s + sc * (dg - zr * qg[:, None])
        dg = dg * 0.0
    return s, dg


@triton.jit
def _kplane(s, dg, kb, qa, qg, PL: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr, GROUP: tl.constexpr,
            NG: tl.constexpr, ks, kz, USE_ASM: tl.constexpr, G: tl.constexpr, W: tl.constexpr, SUB: tl.constexpr):
    dg = tl.dot(qa, decode_plane(kb, PL, BITS, USE_ASM), dg)
    return _kfix(s, dg, PL, WP, GROUP, NG, ks, kz, qg, G, W, SUB)


@triton.jit
def _vplane(acc, zacc, pvw, zs, vb, p, PL: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr,
            GROUP: tl.constexpr, NG: tl.constexpr, vs, vz, USE_ASM: tl.constexpr, G: tl.constexpr,
            W: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr):
    if (PL * WP) % GROUP == 0:
        g: tl.constexpr = (PL * WP) // GROUP
        pv = (p * rows_of(_group(vs, g, NG), G, W, SUB)).to(tl.float16)
        zs = tl.sum(pv.to(tl.float32) * rows_of(_group(vz, g, NG), G, W, SUB), axis=1)
        cols = tl.arange(0, W * SUB)
        ws = tl.arange(0, ROWS) % W
        wide = tl.reshape(tl.broadcast_to(pv[:, None, :], [ROWS, W, SUB]), [ROWS, W * SUB])
        pvw = tl.where((cols[None, :] // SUB) == ws[:, None], wide, 0.0).to(tl.float16)
    acc = tl.dot(pvw, decode_plane(vb, PL, BITS, USE_ASM), acc)
    return acc, zacc + zs, pvw, zs


@triton.jit
def history_block_s(qa0, qa1, qa2, qa3, g0, g1, g2, g3, m, l, a0, a1, a2, a3, z0, z1, z2, z3,
                    kc_ptr, vc_ptr, ks, kz, vs, vz, rowq, tmask, qk_scale,
                    G: tl.constexpr, W: tl.constexpr, BN: tl.constexpr, BITS: tl.constexpr,
                    WP: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, NPL: tl.constexpr,
                    USE_ASM: tl.constexpr, KLOAD: tl.constexpr = 1):
    SUB: tl.constexpr = BN // W
    ROWS: tl.constexpr = G * W
    c = tl.arange(0, WP)
    rq = tl.reshape(rowq, [W, SUB])
    tm = tl.reshape(tmask, [W, SUB])
    if KLOAD == 0:
        kptr = kc_ptr + tl.reshape(rq[:, None, :] * WP + c[None, :, None], [W * WP, SUB])
        kmask = tl.reshape(tl.broadcast_to(tm[:, None, :], [W, WP, SUB]), [W * WP, SUB])
        kb = tl.load(kptr, mask=kmask, other=0)  # [W * WP, SUB]: ((w, j), n) = byte j of token w * SUB + n
    else:
        kb = tl.load(kc_ptr + rowq[:, None] * WP + c[None, :], mask=tmask[:, None], other=0)
        kb = tl.reshape(tl.permute(tl.reshape(kb, [W, SUB, WP]), (0, 2, 1)), [W * WP, SUB])
    vb = tl.load(vc_ptr + rowq[:, None] * WP + c[None, :], mask=tmask[:, None], other=0)
    s = tl.zeros([ROWS, SUB], tl.float32)
    dg = tl.zeros([ROWS, SUB], tl.float32)
    s, dg = _kplane(s, dg, kb, qa0, pick4((0 * WP) // GROUP, g0, g1, g2, g3), 0, BITS, WP, GROUP, NG, ks, kz, USE_ASM, G, W, SUB)
    s, dg = _kplane(s, dg, kb, qa1, pick4((1 * WP) // GROUP, g0, g1, g2, g3), 1, BITS, WP, GROUP, NG, ks, kz, USE_ASM, G, W, SUB)
    if NPL == 4:
        s, dg = _kplane(s, dg, kb, qa2, pick4((2 * WP) // GROUP, g0, g1, g2, g3), 2, BITS, WP, GROUP, NG, ks, kz, USE_ASM, G, W, SUB)
        s, dg = _kplane(s, dg, kb, qa3, pick4((3 * WP) // GROUP, g0, g1, g2, g3), 3, BITS, WP, GROUP, NG, ks, kz, USE_ASM, G, W, SUB)
    s = tl.where(rows_of(tmask, G, W, SUB), s * qk_scale, float("-inf"))
    p, alpha, m, l = softmax_step(s, m, l)
    al = alpha[:, None]
    pvw = tl.zeros([ROWS, BN], tl.float16)
    zs = tl.zeros([ROWS], tl.float32)
    a0, z0, pvw, zs = _vplane(a0 * al, z0 * alpha, pvw, zs, vb, p, 0, BITS, WP, GROUP, NG, vs, vz, USE_ASM, G, W, SUB, ROWS)
    a1, z1, pvw, zs = _vplane(a1 * al, z1 * alpha, pvw, zs, vb, p, 1, BITS, WP, GROUP, NG, vs, vz, USE_ASM, G, W, SUB, ROWS)
    if NPL == 4:
        a2, z2, pvw, zs = _vplane(a2 * al, z2 * alpha, pvw, zs, vb, p, 2, BITS, WP, GROUP, NG, vs, vz, USE_ASM, G, W, SUB, ROWS)
        a3, z3, pvw, zs = _vplane(a3 * al, z3 * alpha, pvw, zs, vb, p, 3, BITS, WP, GROUP, NG, vs, vz, USE_ASM, G, W, SUB, ROWS)
    return m, l, a0, a1, a2, a3, z0, z1, z2, z3


@triton.jit
def _to_std(x, G: tl.constexpr, ROWS: tl.constexpr):
    """[G] -> [ROWS]: row r holds x[r % G] (the kernel's standard rows: head r % G_Q)."""
    return tl.reshape(tl.broadcast_to(x[None, :], [ROWS // G, G]), [ROWS])


@triton.jit
def _to_std2(x, G: tl.constexpr, ROWS: tl.constexpr, WP: tl.constexpr):
    return tl.reshape(tl.broadcast_to(x[None, :, :], [ROWS // G, G, WP]), [ROWS, WP])


@triton.jit
def merge_streams(m, l, a0, a1, a2, a3, z0, z1, z2, z3, G: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Stream rows (head r // W, stream r % W) -> the standard rows (head r % G), streams merged."""
    ROWS: tl.constexpr = G * W
    m2 = tl.reshape(m, [G, W])
    mt = tl.max(m2, axis=1)
    w = tl.math.exp2(m2 - mt[:, None])
    l = tl.sum(tl.reshape(l, [G, W]) * w, axis=1)
    w3 = w[:, :, None]
    a0 = tl.sum(tl.reshape(a0, [G, W, WP]) * w3, axis=1)
    a1 = tl.sum(tl.reshape(a1, [G, W, WP]) * w3, axis=1)
    a2 = tl.sum(tl.reshape(a2, [G, W, WP]) * w3, axis=1)
    a3 = tl.sum(tl.reshape(a3, [G, W, WP]) * w3, axis=1)
    z0 = tl.sum(tl.reshape(z0, [G, W]) * w, axis=1)
    z1 = tl.sum(tl.reshape(z1, [G, W]) * w, axis=1)
    z2 = tl.sum(tl.reshape(z2, [G, W]) * w, axis=1)
    z3 = tl.sum(tl.reshape(z3, [G, W]) * w, axis=1)
    return (_to_std(mt, G, ROWS), _to_std(l, G, ROWS), _to_std2(a0, G, ROWS, WP), _to_std2(a1, G, ROWS, WP),
            _to_std2(a2, G, ROWS, WP), _to_std2(a3, G, ROWS, WP), _to_std(z0, G, ROWS), _to_std(z1, G, ROWS),
            _to_std(z2, G, ROWS), _to_std(z3, G, ROWS))
