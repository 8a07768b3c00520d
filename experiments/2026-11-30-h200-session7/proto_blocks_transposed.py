"""Rejected prototype (session 7, offline only): the INT-b history block with keys on the M side
of the dots (S^T = K q^T, q^T a loop-invariant B operand of 8 columns, 4 of them padding).

Compiled for sm_90 with Triton 3.6 inside a copy of the decode kernel (history programs only):
973 SASS instructions per 128-key block against 986, 29 barriers against 21, the decoded V
planes transposed through shared memory (16 STS.128); 2 warps spilled. Not timed on the GPU.
"""
import triton
import triton.language as tl

from oscar_compile.kernels.attention_blocks_triton import decode_plane


@triton.jit
def history_block_t(q0, q1, q2, q3, qg, m, l, a0, a1, a2, a3, zacc,
                    kc_ptr, vc_ptr, ks, kz, vs, vz, rowq, tmask, qk_scale,
                    BN: tl.constexpr, BITS: tl.constexpr, WP: tl.constexpr, NPL: tl.constexpr,
                    USE_ASM: tl.constexpr):
    """q0..q3: [WP, RT] fp16 planes of q^T; a0..a3: [WP, RT]; m, l, zacc, qg: [RT];
    ks.. : [BN] float32 (GROUP == D)."""
    c = tl.arange(0, WP)[None, :]
    kb = tl.load(kc_ptr + rowq[:, None] * WP + c, mask=tmask[:, None], other=0)  # [BN, WP] u8
    vb = tl.load(vc_ptr + rowq[:, None] * WP + c, mask=tmask[:, None], other=0)
    dg = tl.dot(decode_plane(kb, 0, BITS, USE_ASM), q0)
    dg = tl.dot(decode_plane(kb, 1, BITS, USE_ASM), q1, dg)
    if NPL == 4:
        dg = tl.dot(decode_plane(kb, 2, BITS, USE_ASM), q2, dg)
        dg = tl.dot(decode_plane(kb, 3, BITS, USE_ASM), q3, dg)
    s = ks[:, None] * (dg - kz[:, None] * qg[None, :])  # [BN, RT]
    s = tl.where(tmask[:, None], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.math.exp2(m - m_new)
    p = tl.math.exp2(s - m_new[None, :])
    l = l * alpha + tl.sum(p, axis=0)
    pv = (p * vs[:, None]).to(tl.float16)
    zacc = zacc * alpha + tl.sum(pv.to(tl.float32) * vz[:, None], axis=0)
    al = alpha[None, :]
    a0 = tl.dot(tl.trans(decode_plane(vb, 0, BITS, USE_ASM)), pv, a0 * al)
    a1 = tl.dot(tl.trans(decode_plane(vb, 1, BITS, USE_ASM)), pv, a1 * al)
    if NPL == 4:
        a2 = tl.dot(tl.trans(decode_plane(vb, 2, BITS, USE_ASM)), pv, a2 * al)
        a3 = tl.dot(tl.trans(decode_plane(vb, 3, BITS, USE_ASM)), pv, a3 * al)
    return m_new, l, a0, a1, a2, a3, zacc
