"""Prototype: history block as W independent sub-blocks (3-D batched dots, one per warp)."""
import triton
import triton.language as tl
from oscar_compile.kernels.attention_blocks_triton import decode_plane, pick4


@triton.jit
def _group3(x, g: tl.constexpr, NG: tl.constexpr):
    if NG == 1:
        out = tl.reshape(x, [x.shape[0], x.shape[1]]).to(tl.float32)
    else:
        out = tl.sum(tl.where(tl.arange(0, NG)[None, None, :] == g, x.to(tl.float32), 0.0), axis=2)
    return out


@triton.jit
def _kfix(s, dg, PL: tl.constexpr, WP: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, ks, kz, qg):
    if ((PL + 1) * WP) % GROUP == 0:
        g: tl.constexpr = (PL * WP) // GROUP
        sc = _group3(ks, g, NG)
        zr = _group3(kz, g, NG)
        s = s + sc[:, None, :] * (dg - zr[:, None, :] * qg[:, :, None])
        dg = dg * 0.0
    return s, dg


@triton.jit
def _kplane(s, dg, kb, qp, qg, PL: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr,
            GROUP: tl.constexpr, NG: tl.constexpr, ks, kz, USE_ASM: tl.constexpr):
    dg = tl.dot(qp, tl.permute(decode_plane(kb, PL, BITS, USE_ASM), (0, 2, 1)), dg)
    return _kfix(s, dg, PL, WP, GROUP, NG, ks, kz, qg)


@triton.jit
def _vplane(acc, zacc, pv, zs, vb, p, PL: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr,
            GROUP: tl.constexpr, NG: tl.constexpr, vs, vz, USE_ASM: tl.constexpr):
    if (PL * WP) % GROUP == 0:
        g: tl.constexpr = (PL * WP) // GROUP
        sc = _group3(vs, g, NG)
        zr = _group3(vz, g, NG)
        pv = (p * sc[:, None, :]).to(tl.float16)
        zs = tl.sum(pv.to(tl.float32) * zr[:, None, :], axis=2)
    acc = tl.dot(pv, decode_plane(vb, PL, BITS, USE_ASM), acc)
    return acc, zacc + zs, pv, zs


@triton.jit
def history_block_w(q0, q1, q2, q3, g0, g1, g2, g3, m, l, a0, a1, a2, a3, z0, z1, z2, z3,
                    kc_ptr, vc_ptr, ks, kz, vs, vz, rowq, tmask, qk_scale,
                    W: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr, BITS: tl.constexpr,
                    WP: tl.constexpr, GROUP: tl.constexpr, NG: tl.constexpr, NPL: tl.constexpr,
                    USE_ASM: tl.constexpr):
    """rowq, tmask: [W, SUB]; ks..vz: [W, SUB, NG]; q*: [W, ROWS, WP]; g*: [W, ROWS];
    state m, l, z*: [W, ROWS], a*: [W, ROWS, WP]."""
    c = tl.arange(0, WP)[None, None, :]
    kb = tl.load(kc_ptr + rowq[:, :, None] * WP + c, mask=tmask[:, :, None], other=0)
    vb = tl.load(vc_ptr + rowq[:, :, None] * WP + c, mask=tmask[:, :, None], other=0)
    s = tl.zeros([W, ROWS, SUB], tl.float32)
    dg = tl.zeros([W, ROWS, SUB], tl.float32)
    s, dg = _kplane(s, dg, kb, q0, pick4((0 * WP) // GROUP, g0, g1, g2, g3), 0, BITS, WP, GROUP, NG, ks, kz, USE_ASM)
    s, dg = _kplane(s, dg, kb, q1, pick4((1 * WP) // GROUP, g0, g1, g2, g3), 1, BITS, WP, GROUP, NG, ks, kz, USE_ASM)
    if NPL == 4:
        s, dg = _kplane(s, dg, kb, q2, pick4((2 * WP) // GROUP, g0, g1, g2, g3), 2, BITS, WP, GROUP, NG, ks, kz, USE_ASM)
        s, dg = _kplane(s, dg, kb, q3, pick4((3 * WP) // GROUP, g0, g1, g2, g3), 3, BITS, WP, GROUP, NG, ks, kz, USE_ASM)
    s = tl.where(tmask[:, None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=2))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[:, :, None])
    l = l * alpha + tl.sum(p, axis=2)
    m = m_new
    al = alpha[:, :, None]
    pv = tl.zeros([W, ROWS, SUB], tl.float16)
    zs = tl.zeros([W, ROWS], tl.float32)
    a0, z0, pv, zs = _vplane(a0 * al, z0 * alpha, pv, zs, vb, p, 0, BITS, WP, GROUP, NG, vs, vz, USE_ASM)
    a1, z1, pv, zs = _vplane(a1 * al, z1 * alpha, pv, zs, vb, p, 1, BITS, WP, GROUP, NG, vs, vz, USE_ASM)
    if NPL == 4:
        a2, z2, pv, zs = _vplane(a2 * al, z2 * alpha, pv, zs, vb, p, 2, BITS, WP, GROUP, NG, vs, vz, USE_ASM)
        a3, z3, pv, zs = _vplane(a3 * al, z3 * alpha, pv, zs, vb, p, 3, BITS, WP, GROUP, NG, vs, vz, USE_ASM)
    return m, l, a0, a1, a2, a3, z0, z1, z2, z3


@triton.jit
def merge_w(m, l, a0, a1, a2, a3, z0, z1, z2, z3):
    """Combine the W sub-states [W, ROWS(, WP)] into one [ROWS(, WP)] state."""
    mt = tl.max(m, axis=0)
    w = tl.math.exp2(m - mt[None, :])
    l = tl.sum(l * w, axis=0)
    wa = w[:, :, None]
    return (mt, l, tl.sum(a0 * wa, axis=0), tl.sum(a1 * wa, axis=0), tl.sum(a2 * wa, axis=0),
            tl.sum(a3 * wa, axis=0), tl.sum(z0 * w, axis=0), tl.sum(z1 * w, axis=0),
            tl.sum(z2 * w, axis=0), tl.sum(z3 * w, axis=0))
