"""PROTOTYPE (issue #32): plain-torch pack / unpack of the masked-in-place INT2 page format, an emulation
of the kernel's register tiles, and a reference of the new kernel's arithmetic. Not product code.

Page = 16 tokens x 128 channels x 2 bits = 512 bytes per KV head (same pool shapes as today,
[N_q, H_kv, 16, 32] uint8; only the byte order inside a page changes).
Keys:   byte 128 q + 32 t + 8 s + 4 hh + b, bit pair j  = token 4 q + j, channel 32 s + 16 hh + 4 t + b
Values: byte 16 (8 w + g) + 4 s + b,        bit pair j  = token 4 s + b, channel 16 w + g + 8 (j & 1) + 64 (j >> 1)
Bit pair j = 3 holds (c + 2) mod 4 (read as a signed byte, the masked value is 64 (c - 2)).
"""
from __future__ import annotations

import torch

from oscar_compile import quant


def _fix_top(c: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return torch.where(j == 3, (c + 2) % 4, c)


def pack_keys_v2(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., 16 tokens, 128 channels] (0..3) -> [..., 512] uint8."""
    lead = codes.shape[:-2]
    c = codes.to(torch.int32).reshape(*lead, 4, 4, 4, 2, 4, 4)  # q j | s hh t b
    j = torch.arange(4).view(4, 1, 1, 1, 1)
    c = _fix_top(c, j) << (2 * j)
    byte = c.sum(dim=-5)  # [..., q, s, hh, t, b]
    byte = byte.permute(*range(len(lead)), -5, -2, -4, -3, -1)  # q t s hh b
    return byte.reshape(*lead, 512).to(torch.uint8)


def unpack_keys_v2(packed: torch.Tensor) -> torch.Tensor:
    lead = packed.shape[:-1]
    b = packed.to(torch.int32).reshape(*lead, 4, 4, 4, 2, 4)  # q t s hh b
    j = torch.arange(4).view(4, 1, 1, 1, 1, 1)
    c = (b.unsqueeze(-6) >> (2 * j)) & 3  # [..., j, q, t, s, hh, b]
    c = torch.where(j == 3, (c + 2) % 4, c)  # (c + 2) mod 4 is its own inverse
    n = len(lead)
    c = c.permute(*range(n), n + 1, n, n + 3, n + 4, n + 2, n + 5)  # q j s hh t b
    return c.reshape(*lead, 16, 128).to(torch.uint8)


def pack_values_v2(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., 16 tokens, 128 channels] -> [..., 512] uint8."""
    lead = codes.shape[:-2]
    n = len(lead)
    c = codes.to(torch.int32).reshape(*lead, 4, 4, 2, 4, 2, 8)  # s b | j1 w j0 g
    j = (torch.arange(2).view(2, 1, 1, 1) * 2 + torch.arange(2).view(1, 1, 2, 1))  # [j1, w, j0, g] -> j
    c = _fix_top(c, j) << (2 * j)
    byte = c.sum(dim=(-4, -2))  # [..., s, b, w, g]
    byte = byte.permute(*range(n), n + 2, n + 3, n, n + 1)  # w g s b
    return byte.reshape(*lead, 512).to(torch.uint8)


def unpack_values_v2(packed: torch.Tensor) -> torch.Tensor:
    lead = packed.shape[:-1]
    n = len(lead)
    b = packed.to(torch.int32).reshape(*lead, 4, 8, 4, 4)  # w g s b
    out = torch.empty(*lead, 4, 4, 2, 4, 2, 8, dtype=torch.int32)  # s b j1 w j0 g
    for j1 in range(2):
        for j0 in range(2):
            jj = j0 + 2 * j1
            c = (b >> (2 * jj)) & 3
            if jj == 3:
                c = (c + 2) % 4
            out[..., j1, :, j0, :] = c.permute(*range(n), n + 2, n + 3, n, n + 1)
    return out.reshape(*lead, 16, 128).to(torch.uint8)


def repack_pools(pools):
    """Today's planar pools -> the same pools with k_codes / v_codes in the v2 byte order."""
    out = []
    for name, x in zip(pools._fields, pools):
        if name in ("k_codes", "v_codes"):
            codes = quant.unpack_codes(x.cpu(), 2)  # [N_q, H, 16, 128]
            pk = (pack_keys_v2 if name == "k_codes" else pack_values_v2)(codes)
            x = pk.view(*x.shape).to(x.device)
        out.append(x)
    return type(pools)(*out)


# ------------------------------------------------------------------ emulation of the kernel's tiles
def _as_signed(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 128, x - 256, x)


def emulate_key_tile(pages: torch.Tensor) -> torch.Tensor:
    """pages [8, 512] packed key pages of one step -> A [128 rows m, 128 K] exactly as _key_operands
    builds it (signed masked bytes; K = 32 s + 16 hh + 4 t + b)."""
    words = pages.to(torch.int32).view(8, 4, 4, 8, 4)  # page, q, t, word(s hh), byte
    # thread (w, g): page 2 w + (g >> 2), q = g & 3
    w = torch.arange(4).view(4, 1)
    g = torch.arange(8).view(1, 8)
    kb = words[2 * w + (g >> 2), g & 3]  # [4 w, 8 g, 4 t, 8, 4 b]
    kb = kb.reshape(4, 8, 4, 4, 2, 4)  # w g t s hh b
    planes = [_as_signed(kb & (3 << (2 * j))) for j in range(4)]
    c = torch.stack([torch.stack(planes[0:2], -1), torch.stack(planes[2:4], -1)], -1)  # ... j0 j1
    c = c.permute(7, 0, 6, 1, 3, 4, 2, 5)  # j1 w j0 g | s hh t b
    return c.reshape(128, 128)


def emulate_value_tile(pages: torch.Tensor) -> torch.Tensor:
    """pages [8, 512] packed value pages -> A [128 channels, 128 K] as _value_operand builds it."""
    words = pages.to(torch.int32).view(8, 4, 8, 4, 4)  # page, w, g, s, b
    t = torch.arange(4).view(4, 1)
    hh = torch.arange(2).view(1, 2)
    vb = words[t + 4 * hh]  # [4 t, 2 hh, 4 w, 8 g, 4 s, 4 b]
    vb = vb.permute(2, 3, 0, 1, 4, 5)  # w g t hh s b
    planes = [_as_signed(vb & (3 << (2 * j))) for j in range(4)]
    c = torch.stack([torch.stack(planes[0:2], -1), torch.stack(planes[2:4], -1)], -1)
    c = c.permute(7, 0, 6, 1, 4, 3, 2, 5)  # j1 w j0 g | s hh t b
    return c.reshape(128, 128)


def row_token(m: torch.Tensor) -> torch.Tensor:
    """Step token (16 page + row in page) of score row m."""
    g = m & 7
    j = ((m >> 3) & 1) + 2 * (m >> 6)
    return 16 * (2 * ((m >> 4) & 3) + (g >> 2)) + 4 * (g & 3) + j


def value_k_token(k: torch.Tensor) -> torch.Tensor:
    """Step token at value K index k = 32 s + 16 hh + 4 t + b: page t + 4 hh, row 4 s + b."""
    b, t, hh, s = k & 3, (k >> 2) & 3, (k >> 4) & 1, k >> 5
    return 16 * (t + 4 * hh) + 4 * s + b


def p_to_k(m: torch.Tensor) -> torch.Tensor:
    """K index where the kernel stores P' of score row m (the permute in _history_v2)."""
    bit = lambda i: (m >> i) & 1  # noqa: E731
    return (bit(3) | bit(6) << 1 | bit(2) << 2 | bit(4) << 3 | bit(5) << 4 | bit(0) << 5 | bit(1) << 6)


def p_to_k_by_permute() -> torch.Tensor:
    """The same, through the reshape / permute the kernel applies to the P' tile."""
    m = torch.arange(128)
    pk = m.view(2, 2, 2, 2, 2, 2, 2).permute(5, 6, 1, 2, 4, 0, 3).reshape(128)  # pk[K] = m
    k_of_m = torch.empty(128, dtype=torch.long)
    k_of_m[pk] = torch.arange(128)
    return k_of_m


def check_format(seed: int = 0) -> list[str]:
    """CPU checks: bitwise round trips, byte ownership, and the emulated register tiles."""
    gen = torch.Generator().manual_seed(seed)
    msgs = []
    codes = torch.randint(0, 4, (3, 2, 16, 128), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_keys_v2(pack_keys_v2(codes)), codes)
    assert torch.equal(unpack_values_v2(pack_values_v2(codes)), codes)
    msgs.append("pack/unpack round trip bitwise: keys ok, values ok")
    # ownership: value bytes -> one token each; key bytes -> 4 consecutive tokens of the page
    base = pack_values_v2(codes[0, 0])
    for tok in (0, 5, 15):
        c2 = codes[0, 0].clone()
        c2[tok] = (c2[tok] + 1) % 4
        diff = (pack_values_v2(c2) != base).nonzero().flatten()
        other = [t for t in range(16) if t != tok]
        c3 = codes[0, 0].clone()
        c3[other] = (c3[other] + 1) % 4
        assert not set(diff.tolist()) & set((pack_values_v2(c3) != base).nonzero().flatten().tolist())
    kbase = pack_keys_v2(codes[0, 0])
    for tok in (0, 6, 15):
        c2 = codes[0, 0].clone()
        c2[tok] = (c2[tok] + 1) % 4
        diff = (pack_keys_v2(c2) != kbase).nonzero().flatten()
        assert all(128 * (tok // 4) <= d < 128 * (tok // 4 + 1) for d in diff.tolist())
    msgs.append("byte ownership: a value byte belongs to one token; a key byte to 4 tokens of one quad")
    # emulated register tiles: one 128-token step over 8 pages
    step = torch.randint(0, 4, (8, 16, 128), generator=gen, dtype=torch.uint8)  # page, row, channel
    tok_codes = step.reshape(128, 128).to(torch.int64)  # step token -> channel codes
    A = emulate_key_tile(pack_keys_v2(step))
    m = torch.arange(128)
    jrow = ((m >> 3) & 1) + 2 * (m >> 6)
    want = tok_codes[row_token(m)]
    want = torch.where((jrow == 3).view(-1, 1), want - 2, want) * (4 ** jrow).view(-1, 1)
    assert torch.equal(A.to(torch.int64), want), "key tile"
    V = emulate_value_tile(pack_values_v2(step))  # [channel m, K]
    k = torch.arange(128)
    wantv = tok_codes[value_k_token(k)].T  # [channel, K]
    wantv = torch.where((jrow == 3).view(-1, 1), wantv - 2, wantv) * (4 ** jrow).view(-1, 1)
    assert torch.equal(V.to(torch.int64), wantv), "value tile"
    assert torch.equal(p_to_k(m), p_to_k_by_permute()), "P' permutation"
    assert torch.equal(value_k_token(p_to_k(m)), row_token(m)), "P' row -> value K is the same token"
    msgs.append("emulated A tiles (keys, values) equal 4^j (c - 2[j=3]) at the right token/channel; "
                "P' row m lands at the value K of the same token")
    return msgs


# ------------------------------------------------------------------ reference of the new arithmetic
def quantize_query(q: torch.Tensor, mult: int = 512, qlo: bool = False):
    """q [G, 128] (one program's heads) -> (qi, m [G, 4] int, base): q ~ base * m_g * qi (qlo: qi is
    hi + lo / 128, the 15-bit query of the QLO kernel)."""
    x = q.double().view(q.shape[0], 4, 32)
    amax_g = x.abs().amax(-1)  # [G, 4]
    A = max(float(amax_g.max()), 1e-30)
    x32 = x.float()
    unit = torch.tensor(A, dtype=torch.float32) / 512.0
    base = torch.tensor(A, dtype=torch.float32) / (127.0 * 512.0)
    m = torch.clamp((amax_g.float() / unit).to(torch.int32) + 1, max=mult)
    xs = x32 / (base * m.float()).unsqueeze(-1)
    qi = (xs + torch.where(xs >= 0, 0.5, -0.5)).to(torch.int32).clamp(-127, 127)
    if qlo:
        r = 128.0 * (xs - qi.float())
        lo = (r + torch.where(r >= 0, 0.5, -0.5)).to(torch.int32).clamp(-127, 127)
        return (qi.double() + lo.double() / 128.0).view(q.shape[0], 128), m, float(base)
    return qi.view(q.shape[0], 128), m, float(base)


def attention_v2_ref(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, pools, scale, sink, recent,
                     history_lens=None, exact=False, exact_q=False, exact_p=False, qlo=False, plo=False):
    """What the v2 kernel computes, in float64: int8 query with group multipliers, P' rounded to
    127 levels per 128-token step (its own per-head max of P s_v), the rest exact. ``pools`` hold
    today's planar codes (the reference decodes them directly). ``exact``: no int8 query and no
    P' rounding (the fp64 attention over the dequantized cache, the error yardstick)."""
    from oscar_compile.kernels.attention_ref import gather_cached
    from oscar_compile.kernels.pools import history_lens_of

    LOG2E = 1.4426950408889634
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    g = H_q // H_kv
    P = pools.k_win.shape[2]
    hists = history_lens_of(cache_lens, history_lens, sink, recent)
    out = torch.zeros(N, H_q, D, dtype=torch.float64)
    cu = cu_seqlens.tolist()
    for i, L in enumerate(cache_lens.tolist()):
        a, b = cu[i], cu[i + 1]
        if a == b:
            continue
        h = hists[i]
        common = (window_table.cpu(), quant_table.cpu())
        kc = gather_cached(i, L, *common, pools.k_win.cpu(), pools.k_codes.cpu(), pools.k_scale.cpu(),
                           pools.k_zero.cpu(), sink, recent, 2, 128, h).double()
        vc = gather_cached(i, L, *common, pools.v_win.cpu(), pools.v_codes.cpu(), pools.v_scale.cpu(),
                           pools.v_zero.cpu(), sink, recent, 2, 128, h).double()
        pos = torch.arange(L)
        hist = (pos >= sink) & (pos < sink + h)
        hp = pos[hist] - sink
        pages = quant_table[i].cpu()[hp // P].long()
        rows = hp % P
        codes_k = quant.unpack_codes(pools.k_codes.cpu()[pages, :, rows], 2).double()  # [h, H_kv, 128]
        codes_v = quant.unpack_codes(pools.v_codes.cpu()[pages, :, rows], 2).double()
        ks = pools.k_scale.cpu()[pages, :, rows, 0].double()
        kz = pools.k_zero.cpu()[pages, :, rows, 0].double()
        vs = pools.v_scale.cpu()[pages, :, rows, 0].double()
        vz = pools.v_zero.cpu()[pages, :, rows, 0].double()
        for n in range(a, b):
            t = n - a
            for kh in range(H_kv):
                qh = q[n, kh * g:(kh + 1) * g].float().cpu()  # [g, D]
                qi, m, base = quantize_query(qh, qlo=qlo)
                qt = (base * m.double().repeat_interleave(32, dim=1) * qi.double())  # [g, D] dequantized int8 query
                if exact or exact_q:
                    qt = qh.double()
                # history scores (log2 units) with the int8 query; window + chunk with the 16-bit query
                s_h = (qt @ (ks[:, kh, None] * (codes_k[:, kh] - kz[:, kh, None])).T) * scale * LOG2E  # [g, h]
                wk = torch.cat([kc[~hist, kh], k[a:t + a + 1, kh].double().cpu()], 0)
                wv = torch.cat([vc[~hist, kh], v[a:t + a + 1, kh].double().cpu()], 0)
                s_w = (qh.double() @ wk.T) * scale * LOG2E  # [g, nw]
                M = max(float(s_h.max()) if h else -1e300, float(s_w.max()))
                num = torch.exp2(s_w - M) @ wv  # [g, D]
                den = torch.exp2(s_w - M).sum(-1)
                if h:
                    sp = s_h + torch.log2(vs[:, kh]).view(1, -1)  # s' = s + log2 s_v
                    nsteps = -(-h // 128)
                    pad = nsteps * 128 - h
                    spp = torch.nn.functional.pad(sp, (0, pad), value=float("-inf")).view(g, nsteps, 128)
                    mstep = spp.amax(-1, keepdim=True)
                    pint = 127.0 * torch.exp2(spp - mstep)
                    if plo and not (exact or exact_p):
                        hi = torch.round(pint)
                        pint = hi + torch.round(128.0 * (pint - hi)) / 128.0
                    elif not (exact or exact_p):
                        pint = torch.round(pint)  # P' per step
                    wstep = torch.exp2(mstep - M) / 127.0  # [g, nsteps, 1]
                    pq = (pint * wstep).view(g, -1)[:, :h]  # ~ P s_v exp(.. - M)
                    num = num + pq @ (codes_v[:, kh] - vz[:, kh, None])
                    den = den + torch.exp2(s_h - M).sum(-1)
                out[n, kh * g:(kh + 1) * g] = num / den.view(-1, 1)
    return out


if __name__ == "__main__":
    for line in check_format():
        print(line)
