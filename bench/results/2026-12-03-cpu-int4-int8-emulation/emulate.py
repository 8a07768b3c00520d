"""CPU emulation of the 8-bit integer Gluon decode kernel's arithmetic (attention_gluon_int8.py), for INT2
and for INT4 in the same design (issue #32's INT4 item). A prototype: it stays in bench/results.

Per sequence and program (at most 4 query heads of one KV head), history tokens in 128-token steps,
splits of ``split_tokens`` history tokens (each with its own running maximum), then the window part
(sink, ring and the token's own key) exactly in float64, merged in float64, rounded to q.dtype.

Roundings reproduced (kernels/attention_gluon_int8.py ``_history_int8``, attention_gluon_int8_tiles.py
``_q_group`` / ``_q_store``):
- the query: amax over the program's heads and channels; base = amax / (127 * 512), per head and
  32-channel group m = min(int(am / (amax / 512)) + 1, 512); xs = x / (base m) in fp32;
  qi = round-half-away(xs) and lo = round-half-away(128 (xs - qi)), both clamped to +-127;
- the key dot: integer (exact, float64 here) sum_g m_g sum_c q_c A_c with A = 4^j c' (INT2,
  c' = c - 2 in the top bit pair) or 16^j c' (INT4, c' = c - 8 in the top nibble), converted to
  fp32, plus the zero term (zfix - z) 4^j QS in fp32; s = (s_t qk_scale base 4^-j)
  (y_hi + y_lo / 128) + log2 s_v, all fp32;
- online softmax in fp32, per split: m_new, alpha = 2^(m - m_new), pp = 2^(s - m_new);
- P' = hi + lo / 128, hi = round-half-even(127 pp), lo = round-half-even(16256 pp - 128 hi)
  (the product taken exact: an FMA);
- the value dot in integer (exact) per hi / lo column, o = o alpha + acc in fp32; sums of pp,
  pp / s_v and pp z_v in fp32; the epilogue (o_hi + o_lo / 128) 4^-j + shift 127 sum(pp) -
  127 sum(pp z_v), times 1 / 127, in fp32.
Assumed / simplified: key tokens sit in the bit fields by their position mod 4 (INT2) or mod 2
(INT4) (the INT2 layout: a byte holds 4 consecutive tokens); value channels with j = top field:
INT2 the kernel's rows ((m >> 3) & 9) == 9, INT4 the channels with bit 3 set (half of them);
ex2 / lg2 / rcp taken exact in fp32 (the hardware's approx forms are within 2 ulp); fp32 adds
and products not fused except where said; the window part exact (it is attention_gluon's, shared
with the fp16-operand kernel); the merge of partials in float64.

Usage: PYTHONPATH=<worktree> OMP_NUM_THREADS=1 python3 emulate.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from oscar_compile.bench.kernel_setup import quantized_layer
from oscar_compile.kernels.attention_ref import attention_ref, gather_cached
from oscar_compile.kernels.code_layout_ref import read_code_rows
from oscar_compile.kernels.testing import build_case, random_kv

LOG2E = 1.4426950408889634
NEG_INIT = -1.0e30
F32 = torch.float32
F64 = torch.float64


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def round_away(x: torch.Tensor) -> torch.Tensor:
    """The kernel's _round_i: (x + (x >= 0 ? 0.5 : -0.5)) truncated, the add in fp32."""
    return torch.trunc((x + torch.where(x >= 0, 0.5, -0.5).to(F32)).to(F32))


def quantize_query(x: torch.Tensor):
    """x: [P, HP, D] fp32 (P programs of HP heads) -> qi, lo [P, HP, 4, 32] (float64 integers),
    m [P, HP, 4] (float64 integers), base [P] fp32."""
    Pn, HP, D = x.shape
    xg = x.view(Pn, HP, 4, 32)
    am = xg.abs().amax(-1)  # [P, HP, 4]
    amax = am.amax(dim=(1, 2)).clamp_min(1e-30)
    unit = (amax / 512.0).to(F32)
    base = (amax / (127.0 * 512.0)).to(F32)
    m = torch.clamp(torch.trunc((am / unit[:, None, None]).to(F32)) + 1, max=512)
    den = (base[:, None, None] * m).to(F32)
    xs = (xg / den[..., None]).to(F32)
    qi = round_away(xs).clamp(-127, 127)
    lo = round_away((128.0 * (xs - qi)).to(F32)).clamp(-127, 127)
    return qi.double(), lo.double(), m.double(), base


def fields(bits: int):
    """(bit fields per byte n, weight of field j, shift of the top field)."""
    n = 8 // bits
    return n, [float(1 << (bits * j)) for j in range(n)], float(1 << (bits - 1))


def value_top_channels(bits: int, D: int = 128) -> torch.Tensor:
    m = torch.arange(D)
    if bits == 2:
        jj = ((m >> 3) & 1) + 2 * (m >> 6)
    else:
        jj = (m >> 3) & 1
    return jj


def history_partials(q, kc, ks, kz, vc, vs, vz, bits, qk_scale, split_tokens):
    """The int8 kernel's history partials of one sequence.

    q: [H_q, D] fp32; kc, vc: [h, H_kv, D] codes (uint8); ks, kz, vs, vz: [h, H_kv] fp32 (fp16 values).
    -> list of (o [H_q, D] fp32, m [H_q] log2 units, l [H_q]) per split."""
    H_q, D = q.shape
    h, H_kv, _ = kc.shape
    G = H_q // H_kv
    HP = min(G, 4)
    nprog = G // HP
    assert G % HP == 0
    x = q.view(H_kv, nprog, HP, D).reshape(H_kv * nprog, HP, D)
    qi, lo, mg, base = quantize_query(x)
    kv_of_prog = torch.arange(H_kv).repeat_interleave(nprog)
    nf, w, shift = fields(bits)
    # keys: A = w_j c', c' = c - shift in the top field; j = token position mod nf
    jt = torch.arange(h) % nf
    powk = torch.tensor(w, dtype=F64)[jt]  # [h]
    topk = (jt == nf - 1).double()
    A = (kc.double() - shift * topk[:, None, None]) * powk[:, None, None]  # [h, H_kv, D]
    Ap = A[:, kv_of_prog].view(h, H_kv * nprog, 4, 32)  # [h, P, 4, 32]
    int_hi = torch.einsum("tpgc,phgc->tph", Ap, qi * mg[..., None])  # exact integers
    int_lo = torch.einsum("tpgc,phgc->tph", Ap, lo * mg[..., None])
    QS_hi = (mg * qi.sum(-1)).sum(-1).to(F32)  # [P, HP]
    QS_lo = (mg * lo.sum(-1)).sum(-1).to(F32)
    zfix = (shift * topk).to(F32)
    kzp = kz[:, kv_of_prog].to(F32)  # [h, P]
    zz = ((zfix[:, None] - kzp) * powk.to(F32)[:, None]).to(F32)  # [h, P]
    y_hi = int_hi.to(F32) + (zz[..., None] * QS_hi[None]).to(F32)
    y_lo = int_lo.to(F32) + (zz[..., None] * QS_lo[None]).to(F32)
    kmul = ((torch.tensor(qk_scale, dtype=F32) * base)[None, :] / powk.to(F32)[:, None]).to(F32)  # [h, P]
    a_t = (ks[:, kv_of_prog].to(F32) * kmul).to(F32)
    vsp = vs[:, kv_of_prog].to(F32).clamp_min(1e-30)
    lv = torch.log2(vsp)
    s = (a_t[..., None] * (y_hi + (y_lo * (1.0 / 128.0)).to(F32)).to(F32)).to(F32) + lv[..., None]  # [h, P, HP]
    ivs = (1.0 / vsp).to(F32)
    vzp = vz[:, kv_of_prog].to(F32)
    # values: A_v [h, P, D] = w_j c' per channel
    jv = value_top_channels(bits, D)
    powv = torch.tensor(w, dtype=F64)[jv]
    topv = (jv == nf - 1).double()
    Av = (vc.double() - shift * topv) * powv  # [h, H_kv, D]
    Av = Av[:, kv_of_prog]  # [h, P, D]
    vpow = (1.0 / powv).to(F32)
    vmul = (shift * topv).to(F32)
    out = []
    for s0 in range(0, h, split_tokens):
        s1 = min(h, s0 + split_tokens)
        m_i = torch.full((H_kv * nprog, HP), NEG_INIT, dtype=F32)
        o_hi = torch.zeros(H_kv * nprog, D, HP, dtype=F32)
        o_lo = torch.zeros_like(o_hi)
        l_acc = torch.zeros(H_kv * nprog, HP, dtype=F32)
        ps_acc = torch.zeros_like(l_acc)
        zs_acc = torch.zeros_like(l_acc)
        for n0 in range(s0, s1, 128):
            n1 = min(s1, n0 + 128)
            st = s[n0:n1]  # [n, P, HP] (tokens past the split end: pp = 0, left out)
            m_new = torch.maximum(m_i, st.amax(0).clamp_min(NEG_INIT))
            alpha = torch.exp2(m_i - m_new).to(F32)
            m_i = m_new
            pp = torch.exp2((st - m_new[None]).to(F32)).to(F32)
            p64 = pp.double()
            hi = torch.round(p64 * 127.0)  # half to even, as the MAGIC add
            lo_p = torch.round(p64 * 16256.0 - 128.0 * hi)
            acc_hi = torch.einsum("tpd,tph->pdh", Av[n0:n1], hi)
            acc_lo = torch.einsum("tpd,tph->pdh", Av[n0:n1], lo_p)
            ls = (pp * ivs[n0:n1, :, None]).to(F32).sum(0)
            ps = pp.sum(0)
            zs = (pp * vzp[n0:n1, :, None]).to(F32).sum(0)
            l_acc = (l_acc * alpha).to(F32) + ls
            ps_acc = (ps_acc * alpha).to(F32) + ps
            zs_acc = (zs_acc * alpha).to(F32) + zs
            o_hi = (o_hi * alpha[:, None, :]).to(F32) + acc_hi.to(F32)
            o_lo = (o_lo * alpha[:, None, :]).to(F32) + acc_lo.to(F32)
        o = (o_hi + (o_lo * (1.0 / 128.0)).to(F32)).to(F32)
        ps_t = (ps_acc * 127.0).to(F32)[:, None, :]
        zs_t = (zs_acc * 127.0).to(F32)[:, None, :]
        o = ((o * vpow[None, :, None]).to(F32) + (vmul[None, :, None] * ps_t).to(F32) - zs_t).to(F32)
        o = (o * (1.0 / 127.0)).to(F32)  # [P, D, HP]
        out.append((o.permute(0, 2, 1).reshape(H_q, D), m_i.reshape(H_q), l_acc.reshape(H_q)))
    return out


def window_tiles(s2, vals, wdt):
    """s2: [n, H_q] float64 scores (log2 units; the 16-bit products summed exactly, then fp32),
    vals: [n, H_q, D] -> (o, m, l) float64 of the online softmax over 64-token tiles."""
    s = s2.to(F32)
    H_q, D = s.shape[1], vals.shape[2]
    m_i = torch.full((H_q,), NEG_INIT, dtype=F32)
    o = torch.zeros(H_q, D, dtype=F32)
    l_i = torch.zeros(H_q, dtype=F32)
    for t0 in range(0, s.shape[0], 64):
        st = s[t0:t0 + 64]
        m_new = torch.maximum(m_i, st.amax(0))
        alpha = torch.exp2(m_i - m_new)
        p = torch.exp2(st - m_new)
        l_i = l_i * alpha + p.sum(0)
        pr = p.to(wdt).double()
        o = (o * alpha[:, None]).to(F32) + torch.einsum("th,thd->hd", pr, vals[t0:t0 + 64]).to(F32)
        m_i = m_new
    return o.double(), m_i.double(), l_i.double()


def history_rows(pools, quant_table, i, h, sink, bits, group_size):
    pos = torch.arange(h)
    page, row = quant_table[i, pos // pools.k_win.shape[2]].long(), pos % pools.k_win.shape[2]
    assert group_size == pools.k_win.shape[3], "one scale group per token and head"
    kc = read_code_rows(pools.k_codes, page, row, "k", bits)
    vc = read_code_rows(pools.v_codes, page, row, "v", bits)
    get = lambda t: t[page, :, row][..., 0].float()  # noqa: E731
    return kc, get(pools.k_scale), get(pools.k_zero), vc, get(pools.v_scale), get(pools.v_zero)


def emulate(q, k, v, cache_lens, window_table, quant_table, pools, scale, sink, recent, bits, group_size,
            split_tokens, exact_history=False, window_bf16=False):
    """Decode (one new token per sequence) through the emulated int8 kernel -> (fp32 out, float64
    exact out over the dequantized cache). exact_history: the history in float64 too (a check).
    window_bf16: the window part as attention_gluon's ``_full_tile`` does it (64-token tiles in
    position order, fp32 scores of the 16-bit operands, online softmax in fp32, P rounded to the
    window dtype for the value product, l from the unrounded P); else exact."""
    B, H_q, D = q.shape
    H_kv = k.shape[1]
    G = H_q // H_kv
    qk_scale = float(torch.tensor(scale * LOG2E, dtype=F32))
    out = torch.empty(B, H_q, D, dtype=F32)
    exact = torch.empty(B, H_q, D, dtype=F64)
    for i, L in enumerate(cache_lens.tolist()):
        h = max(0, L - recent - sink)
        geo = (sink, recent, bits, group_size, h)
        kd = gather_cached(i, L, window_table, quant_table, pools.k_win, pools.k_codes, pools.k_scale,
                           pools.k_zero, *geo, kind="k")
        vd = gather_cached(i, L, window_table, quant_table, pools.v_win, pools.v_codes, pools.v_scale,
                           pools.v_zero, *geo, kind="v")
        keys = torch.cat([kd, k[i:i + 1].float()]).double().repeat_interleave(G, 1)  # [L+1, H_q, D]
        vals = torch.cat([vd, v[i:i + 1].float()]).double().repeat_interleave(G, 1)
        qd = q[i].double()
        s2 = torch.einsum("hd,thd->th", qd, keys) * (scale * LOG2E)  # log2 units
        M = s2.amax(0)
        p = torch.exp2(s2 - M)
        exact[i] = torch.einsum("th,thd->hd", p, vals) / p.sum(0)[:, None]
        hist = torch.zeros(L + 1, dtype=torch.bool)
        hist[sink:sink + h] = True
        parts = []  # (o unnormalised, m, l) in log2 units, float64
        win = ~hist
        if window_bf16:
            parts.append(window_tiles(s2[win], vals[win], q.dtype))
        else:
            mw = s2[win].amax(0)
            pw = torch.exp2(s2[win] - mw)
            parts.append((torch.einsum("th,thd->hd", pw, vals[win]), mw, pw.sum(0)))
        if h > 0:
            if exact_history:
                mh = s2[hist].amax(0)
                ph = torch.exp2(s2[hist] - mh)
                parts.append((torch.einsum("th,thd->hd", ph, vals[hist]), mh, ph.sum(0)))
            else:
                rows = history_rows(pools, quant_table, i, h, sink, bits, group_size)
                for o, m, lsum in history_partials(q[i].float(), *rows, bits, qk_scale, split_tokens):
                    parts.append((o.double(), m.double(), lsum.double()))
        Mx = torch.stack([m for _, m, _ in parts]).amax(0)
        num = sum(o * torch.exp2(m - Mx)[:, None] for o, m, _ in parts)
        den = sum(lsum * torch.exp2(m - Mx) for _, m, lsum in parts)
        out[i] = (num / den[:, None]).to(F32)
    return out, exact


def format_error(case, q, k, v, scale) -> float:
    """Exact attention over the streams as written (before quantization) against exact attention
    over the dequantized cache: the format's own error (sink and ring hold the stream exactly)."""
    outs = []
    for i, L in enumerate(case.cache_lens.tolist()):
        keys = torch.cat([case.keys[i][:L].double(), k[i:i + 1].double()])
        vals = torch.cat([case.values[i][:L].double(), v[i:i + 1].double()])
        G = q.shape[1] // k.shape[1]
        s = torch.einsum("hd,thd->th", q[i].double(), keys.repeat_interleave(G, 1)) * scale
        p = torch.softmax(s, 0)
        outs.append(torch.einsum("th,thd->hd", p, vals.repeat_interleave(G, 1)))
    return torch.stack(outs)


def run_case(name, q, k, v, case_like, pools, tables, scale, sink, recent, bits, group, splits, orig=None):
    wt, qt = tables
    lens = case_like
    t0 = time.time()
    ref = attention_ref(q, k, v, torch.arange(len(lens) + 1, dtype=torch.int32), lens, wt, qt, *pools, scale, sink,
                        recent, bits, group)
    row = {"case": name, "bits": bits}
    res = {}
    for split in splits:
        emu, exact = emulate(q, k, v, lens, wt, qt, pools, scale, sink, recent, bits, group, split)
        res[split] = emu
        row[f"int8_split{split}_vs_ref"] = rel_err(emu.to(q.dtype), ref)  # as the bench / tests measure
        row[f"int8_split{split}_fp32_vs_exact"] = rel_err(emu, exact)  # the arithmetic alone, unrounded
    for split in (256, 1 << 20):
        emu, _ = emulate(q, k, v, lens, wt, qt, pools, scale, sink, recent, bits, group, split, window_bf16=True)
        row[f"int8_split{split}_winbf16_vs_ref"] = rel_err(emu.to(q.dtype), ref)
    fp, _ = emulate(q, k, v, lens, wt, qt, pools, scale, sink, recent, bits, group, 128, exact_history=True,
                    window_bf16=True)
    row["exacthist_winbf16_vs_ref"] = rel_err(fp.to(q.dtype), ref)  # the window part's share alone
    chk, exact = emulate(q, k, v, lens, wt, qt, pools, scale, sink, recent, bits, group, 128, exact_history=True)
    row["exact_fp32_vs_exact"] = rel_err(chk, exact)  # ~1e-7: the emulation's own plumbing
    row["exact_rounded_vs_ref"] = rel_err(exact.to(q.dtype), ref)  # the reference's fp32 vs float64 (floor)
    if orig is not None:
        row["format_err"] = rel_err(exact, orig)  # (a): the quantized cache against the stream as written
        row["format_err_rounded_ref"] = rel_err(ref, orig)
    row["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(row), flush=True)
    return row


def outlier_case(name, lens, H_q, H_kv, sink, recent, bits, seed, q_gain, splits):
    case = build_case(lens, H_kv, 128, 16, sink, recent, bits, 128, torch.float16, seed=seed, extra_tokens=4)
    gen = torch.Generator().manual_seed(0)
    n = len(lens)
    q, k, v = (random_kv(n, h, 128, gen) for h in (H_q, H_kv, H_kv))
    q = q * q_gain
    scale = 128 ** -0.5
    orig = format_error(case, q, k, v, scale)
    row = run_case(name, q, k, v, case.cache_lens, case.pools, (case.window_table, case.quant_table), scale, sink,
                   recent, bits, 128, splits, orig)
    # the format's error from the codes alone: the same streams written without clipping
    c1 = build_case(lens, H_kv, 128, 16, sink, recent, bits, 128, torch.float16, seed=seed, extra_tokens=4,
                    clip_k=1.0, clip_v=1.0)
    _, exact1 = emulate(q, k, v, c1.cache_lens, c1.window_table, c1.quant_table, c1.pools, scale, sink, recent, bits,
                        128, 128, exact_history=True)
    row["format_err_noclip"] = rel_err(exact1, orig)
    print(json.dumps({"case": name, "bits": bits, "format_err_noclip": row["format_err_noclip"]}), flush=True)
    return row


def bench_codes_case(name, ctx, B, bits, splits):
    """bench.kernels' attention-table inputs: random codes, scales 0.02-0.1, zeros 0-3, randn windows."""
    torch.manual_seed(0)
    pools, tables = quantized_layer(B, ctx, torch.float16, "cpu", bits)
    q = torch.randn(B, 32, 128, dtype=torch.bfloat16)
    k = torch.randn(B, 8, 128, dtype=torch.bfloat16)
    v = torch.randn(B, 8, 128, dtype=torch.bfloat16)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    return run_case(name, q, k, v, lens, pools, tables, 128 ** -0.5, 64, 256, bits, 128, splits)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results.json")
    ap.add_argument("--ctx", type=int, default=8192)
    args = ap.parse_args()
    torch.set_num_threads(1)
    splits = [256, 2048, 1 << 20]  # 2 steps (the 8k / 1 plan), the deterministic split, one split
    rows = []
    lens_ragged = [0, 9, 48, 150, 1000, 333, 2100]
    for bits in (2, 4):
        rows.append(outlier_case("ragged_qwen_layer", lens_ragged, 32, 8, 64, 256, bits, 1, 1.0, splits))
        rows.append(outlier_case(f"outlier_{args.ctx}x2", [args.ctx, args.ctx - 777], 32, 8, 64, 256, bits, 3, 1.0,
                                 splits))
        rows.append(outlier_case(f"outlier_peaked_{args.ctx}x2_qx4", [args.ctx, args.ctx - 777], 32, 8, 64, 256,
                                 bits, 4, 4.0, splits))
        rows.append(bench_codes_case(f"bench_codes_{args.ctx}x1", args.ctx, 1, bits, splits))
    meta = {"command": "emulate.py", "ctx": args.ctx, "splits_tokens": splits,
            "torch": torch.__version__, "threads": torch.get_num_threads()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    assert not any(math.isnan(r.get("int8_split256_vs_ref", 0.0)) for r in rows)


if __name__ == "__main__":
    main()
