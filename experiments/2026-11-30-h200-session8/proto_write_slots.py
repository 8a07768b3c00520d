"""Prototype: the decode cache write with a per-step slot mapping (window slot row, history row
per token, computed once per step and shared by every layer) instead of cu / lens / tables."""
import json, os, sys
import torch
import triton
import triton.language as tl

from oscar_compile.bench.kernels import graph_time_us, decode_write_inputs, LAYERS, H_KV, D, SINK, RECENT, P
from oscar_compile.kernels.cache_write_triton import _write_one, cache_write_triton
from oscar_compile.kernels.quant_triton import clip_indices, zero_low_bits


@triton.jit(do_not_specialize=["N"])
def _slots_kernel(k_ptr, v_ptr, slot_ptr, kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                  N, stride_kn, stride_kh, stride_vn, stride_vh, klo, khi, kfrac, vlo, vhi, vfrac,
                  H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                  CLIP_K: tl.constexpr, CLIP_V: tl.constexpr, BLOCK_T: tl.constexpr, CLIP_LOW: tl.constexpr):
    h = tl.program_id(1) % H
    do_k = tl.program_id(1) < H
    n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    valid = n < N
    wslot = tl.load(slot_ptr + 2 * n, mask=valid, other=-1)
    qslot = tl.load(slot_ptr + 2 * n + 1, mask=valid, other=-1)
    win_mask = wslot >= 0
    quant_mask = qslot >= 0
    demote = win_mask & quant_mask
    rows_win = ((wslot // P).to(tl.int64) * H + h) * P + wslot % P
    rows_q = ((qslot // P).to(tl.int64) * H + h) * P + qslot % P
    d = tl.arange(0, D)[None, :]
    if do_k:
        kin = tl.load(k_ptr + n[:, None] * stride_kn + h * stride_kh + d, mask=valid[:, None], other=0.0)
        k_new = kin.to(kwin_ptr.dtype.element_ty)
        k_old = tl.load(kwin_ptr + rows_win[:, None] * D + d, mask=demote[:, None], other=0.0)
        _write_one(k_new, k_old, kwin_ptr, kc_ptr, ks_ptr, kz_ptr, rows_win, win_mask, rows_q,
                   quant_mask, demote, klo, khi, kfrac, CLIP_K, CLIP_LOW, BLOCK_T, D, BITS, GROUP)
    else:
        vin = tl.load(v_ptr + n[:, None] * stride_vn + h * stride_vh + d, mask=valid[:, None], other=0.0)
        v_new = vin.to(vwin_ptr.dtype.element_ty)
        v_old = tl.load(vwin_ptr + rows_win[:, None] * D + d, mask=demote[:, None], other=0.0)
        _write_one(v_new, v_old, vwin_ptr, vc_ptr, vs_ptr, vz_ptr, rows_win, win_mask, rows_q,
                   quant_mask, demote, vlo, vhi, vfrac, CLIP_V, CLIP_LOW, BLOCK_T, D, BITS, GROUP)


def decode_slots(lens, wt, qt, sink, recent, page):
    """[B, 2] int32 (window slot row, history row or -1) of a decode step (one token each, standard h)."""
    p = lens.long()
    slot = torch.where(p < sink, p, sink + (p - sink) % recent)
    wslot = wt.gather(1, (slot // page)[:, None])[:, 0].long() * page + slot % page
    p_old = p - recent
    dem = (p >= sink) & (p_old >= sink)
    hp = (p_old - sink).clamp(min=0)
    qslot = torch.where(dem, qt.gather(1, (hp // page)[:, None])[:, 0].long() * page + hp % page, -1)
    return torch.stack([wslot, qslot], 1).to(torch.int32).contiguous()


def slots_write(k, v, slots, pools, bits, group, clip_k, clip_v, block_t=1, num_warps=1):
    N, H, Dh = k.shape
    klo, khi, kfrac = clip_indices(clip_k, Dh)
    vlo, vhi, vfrac = clip_indices(clip_v, Dh)
    _slots_kernel[(triton.cdiv(N, block_t), 2 * H)](
        k, v, slots, *pools, N, k.stride(0), k.stride(1), v.stride(0), v.stride(1), klo, khi, kfrac, vlo, vhi, vfrac,
        H=H, D=Dh, P=pools[0].shape[2], BITS=bits, GROUP=group, CLIP_K=clip_k < 1, CLIP_V=clip_v < 1,
        BLOCK_T=block_t, CLIP_LOW=zero_low_bits(pools[0].dtype), num_warps=num_warps, enable_fp_fusion=False)


def main(out):
    dev = torch.device("cuda")
    rows = []
    for B in (1, 8, 32, 64):
        k, v, args = decode_write_inputs(B, dev)
        cu, lens, wt, qt = args[:4]
        pools = args[4:12]
        sink, recent, bits, group, ck, cv = args[12:]
        slots = decode_slots(lens, wt, qt, sink, recent, pools[0].shape[2])
        a = [p.clone() for p in pools]
        b = [p.clone() for p in pools]
        cache_write_triton(k, v, cu, lens, wt, qt, *a, *args[12:])
        slots_write(k, v, slots, b, bits, group, ck, cv)
        equal = all(torch.equal(x, y) for x, y in zip(a, b))
        t_cur = graph_time_us([lambda: cache_write_triton(k, v, *args)] * LAYERS)
        t_slot = graph_time_us([lambda: slots_write(k, v, slots, pools, bits, group, ck, cv)] * LAYERS)
        t_cur2 = graph_time_us([lambda: cache_write_triton(k, v, *args)] * LAYERS)
        t_nc = graph_time_us([lambda: slots_write(k, v, slots, pools, bits, group, 1.0, 1.0)] * LAYERS)
        row = dict(batch=B, current_us=t_cur, current_again_us=t_cur2, slots_us=t_slot, slots_noclip_us=t_nc,
                   bitwise_equal=equal)
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
