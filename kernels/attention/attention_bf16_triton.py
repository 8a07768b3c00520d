"""Triton ``oscar::attention_bf16`` and ``oscar::cache_write_bf16``: the full-precision paged cache.

Same program layout as the INT-b kernel (attention_triton): BLOCK_M new tokens x all g query
heads of one KV head per program, flash-decoding splits of the cached range over the grid's third
axis, the chunk's own keys (causal) in the last split, merge_partials to combine. It is the
runtime's BF16 mode and the baseline that isolates the cost of paging from that of INT-b. The
write is one program per new token storing all of its KV heads (a copy: bitwise the reference's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.kernels.attention.attention_blocks_triton import (
    NEG_INIT,
    full_block,
    merge_partials,
    page_rows,
    program_ids,
    query_rows,
    seq_of_program,
    split_range,
    store_rows,
)
from oscar_compile.kernels.attention.attention_split_plan import deterministic_launch, merge_partials_in_order
from oscar_compile.kernels.attention.decode.attention_triton import (
    LOG2E,
    check_output,
    dot_dtype,
    plan_launch,
    query_block_prefix,
)
from oscar_compile.kernels.determinism import split_tokens


# B and nsplit stay specialized (1 / multiple of 16 / other): without, batch-1 decode measured up to
# 40 % slower on the H200 (2026-11-30). The runner compiles those variants at startup instead.
@triton.jit
def _attn_bf16_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, cub_ptr, lens_ptr, pt_ptr, kp_ptr, vp_ptr,
    out_ptr, po_ptr, pl_ptr, qk_scale, B, nsplit, sqn, sqh, skn, skh, svn, svh, stride_pt,
    H_KV: tl.constexpr, G_Q: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    SPLIT: tl.constexpr, DOT_DT: tl.constexpr, SPLIT_LEN: tl.constexpr,
):
    NPL: tl.constexpr = 2
    WP: tl.constexpr = D // 2
    pid, h, sid, i = program_ids(cub_ptr, B)
    if pid < tl.load(cub_ptr + B):
        start, T, L, t0, r, tok, head, row_ok, q_rows = query_rows(
            q_ptr, cu_ptr, cub_ptr, lens_ptr, pid, h, i, sqn, sqh, G_Q, BLOCK_M, ROWS)
        qf = tl.load(q_rows + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0).to(DOT_DT)
        m = tl.zeros([ROWS], tl.float32) + NEG_INIT
        l = tl.zeros([ROWS], tl.float32)
        a0 = tl.zeros([ROWS, WP], tl.float32)
        a1 = tl.zeros([ROWS, WP], tl.float32)
        z0 = tl.zeros([ROWS], tl.float32)
        do_hist, do_win, lo, hi = split_range(L, sid, nsplit, SPLIT, BLOCK_N, SPLIT_LEN)
        if do_hist:
            pt_row = pt_ptr + i.to(tl.int64) * stride_pt
            for n0 in range(lo, hi, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)
                ok = pos < hi
                rows = page_rows(pt_row, pos, ok, h, H_KV, P)
                key_ok = ok[None, :] & (r[:, None] >= 0)
                m, l, a0, a1, _a2, _a3, z0, _z1, _z2, _z3 = full_block(
                    qf, m, l, a0, a1, a0, a1, z0, z0, z0, z0, kp_ptr, vp_ptr, rows, key_ok,
                    D, D, qk_scale, D, WP, NPL, DOT_DT)
        if do_win:
            kend = tl.minimum(T, t0 + BLOCK_M)
            for j0 in range(0, kend, BLOCK_C):
                j = j0 + tl.arange(0, BLOCK_C)
                key_ok = (j[None, :] <= tok[:, None]) & (j[None, :] < kend)
                m, l, a0, a1, _a2, _a3, z0, _z1, _z2, _z3 = full_block(
                    qf, m, l, a0, a1, a0, a1, z0, z0, z0, z0, k_ptr + h * skh, v_ptr + h * svh,
                    (start + j).to(tl.int64), key_ok, skn, svn, qk_scale, D, WP, NPL, DOT_DT)
        inv_l = tl.where(l > 0.0, 1.0 / l, 0.0)
        n_glob = (start + tok).to(tl.int64)
        zero = tl.zeros([ROWS], tl.float32)
        if not SPLIT:
            base = out_ptr + (n_glob * (H_KV * G_Q) + head)[:, None] * D
            store_rows(base, row_ok, a0, a1, a0, a1, zero, zero, zero, zero, inv_l, WP, NPL)
        else:
            prow = (n_glob * (H_KV * G_Q) + head) * (nsplit + 1) + sid
            store_rows(po_ptr + prow[:, None] * D, row_ok, a0, a1, a0, a1, zero, zero, zero, zero,
                       inv_l, WP, NPL)
            lse = tl.where(l > 0.0, m + tl.math.log2(l), float("-inf"))
            tl.store(pl_ptr + prow, lse, mask=row_ok)


def attention_bf16_triton(q, k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages, scale,
                          block_n: int = 64, num_warps: int = 4, num_stages: int | None = None,
                          nsplit: int | None = None, seq_mask=None, out=None):
    """Check, plan and launch. q: [N, H_q, D], k, v: [N, H_kv, D] -> [N, H_q, D] in q.dtype.

    ``nsplit`` overrides the planned history splits. ``seq_mask`` ([B] bool, on the device)
    computes only those sequences' rows, into ``out`` (given with it), as attention_triton's:
    prefill-like launches without splits only (the extend path, attention_extend_triton).

    ``num_stages`` (pipelining depth) defaults to 3 for a few long splits (a batch of one or two
    with >= 8 blocks per split), else 2: on the H200 (2026-11-30), batch 1 at 32k / 128k took
    43.9 / 140.5 µs with 3 stages and 54.0 / 185.4 with 2, batch 8-32 at 32k-128k 17 % longer
    with 3. (Depth 2 had been right at batch 1 too, until the search for a program's sequence
    changed and the kernel went from 154 to 122 registers.)
    """
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    B = cache_lens.shape[0]
    P = k_pages.shape[2]
    if (seq_mask is None) != (out is None):
        raise ValueError("give seq_mask and out together")
    if H_q % H_kv or D & (D - 1) or D < 32:
        if seq_mask is not None:
            raise ValueError("seq_mask: a shape the kernel does not take (the reference computes every row)")
        from oscar_compile.kernels.attention.attention_bf16_ref import attention_bf16_ref

        return attention_bf16_ref(q, k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages,
                                  scale)
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("q, k, v need a contiguous last dim")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("the pages must be contiguous")
    out = torch.empty(N, H_q, D, dtype=q.dtype, device=q.device) if out is None else check_output(out, q)
    if N == 0:
        return out
    g = H_q // H_kv
    max_hist = page_table.shape[1] * P
    split_len = split_tokens()
    if split_len is not None:  # deterministic mode: one launch shape for every batch
        if seq_mask is not None or nsplit is not None:
            raise ValueError("deterministic mode plans its own launch (no seq_mask or nsplit)")
        block_m, rows, nsplit = deterministic_launch(max_hist, g, split_len, block_n)
    else:
        block_m, rows, planned = plan_launch(N, B, H_kv, g, max_hist, q.device, block_n)
        nsplit = planned if nsplit is None else nsplit
    if seq_mask is not None and (block_m == 1 or nsplit):
        raise ValueError("seq_mask: prefill-like launches without history splits only")
    if num_stages is None and split_len is not None:
        num_stages = 2  # (pipelining moves loads, not arithmetic; fixed all the same)
    if num_stages is None:
        split_blocks = triton.cdiv(triton.cdiv(max_hist, block_n), nsplit) if nsplit else 0
        num_stages = 3 if B * H_kv <= 16 and split_blocks >= 8 else 2
    if block_m == 1:
        cub, nblocks = cu_seqlens, N
    else:
        cub = query_block_prefix(cu_seqlens, block_m, seq_mask)
        nblocks = triton.cdiv(N, block_m) + B
    if nsplit:
        po = torch.empty(N * H_q * (nsplit + 1), D, dtype=torch.float32, device=q.device)
        pl = torch.empty(N * H_q * (nsplit + 1), dtype=torch.float32, device=q.device)
    else:
        po = pl = out
    _attn_bf16_kernel[(nblocks, H_kv, nsplit + 1)](
        q, k, v, cu_seqlens, cub, cache_lens, page_table, k_pages, v_pages, out, po, pl,
        scale * LOG2E, B, nsplit, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), page_table.stride(0),
        H_KV=H_kv, G_Q=g, D=D, P=P, BLOCK_M=block_m, ROWS=rows, BLOCK_N=block_n,
        BLOCK_C=16 if block_m == 1 else 64, SPLIT=nsplit > 0,
        DOT_DT=dot_dtype(k_pages.dtype), SPLIT_LEN=split_len or 0, num_warps=num_warps, num_stages=num_stages,
    )
    if nsplit:
        merge = merge_partials_in_order if split_len is not None else merge_partials
        merge(po, pl, out, nsplit + 1)
    return out


@triton.jit(do_not_specialize=["B"])
def _write_bf16_kernel(k_ptr, v_ptr, cu_ptr, lens_ptr, pt_ptr, kp_ptr, vp_ptr, B, skn, skh, svn, svh, stride_pt,
                       H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """Token n -> row (pos % P) of page table[i, pos // P], every KV head at once."""
    n = tl.program_id(0)
    if n >= tl.load(cu_ptr + B):  # tokens past cu[B] are not written (a cache-less forward passes cu = 0)
        return
    i = seq_of_program(cu_ptr, n, B)
    pos = tl.load(lens_ptr + i) + n - tl.load(cu_ptr + i)
    page = tl.load(pt_ptr + i * stride_pt + pos // P).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H_KV) & (d < D)
    dst = ((page * H_KV + h) * P + pos % P) * D + d
    k = tl.load(k_ptr + n.to(tl.int64) * skn + h * skh + d, mask=mask)
    v = tl.load(v_ptr + n.to(tl.int64) * svn + h * svh + d, mask=mask)
    tl.store(kp_ptr + dst, k.to(kp_ptr.dtype.element_ty), mask=mask)
    tl.store(vp_ptr + dst, v.to(vp_ptr.dtype.element_ty), mask=mask)


def cache_write_bf16_triton(k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages) -> None:
    """One launch for ``oscar::cache_write_bf16`` (the reference's scatter takes about ten)."""
    N, H_kv, D = k.shape
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()) or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the pages and the last dim of k, v must be contiguous")
    if N == 0:
        return
    B = cache_lens.shape[0]
    _write_bf16_kernel[(N,)](
        k, v, cu_seqlens, cache_lens, page_table, k_pages, v_pages, B, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), page_table.stride(0), H_KV=H_kv, D=D, P=k_pages.shape[2],
        BLOCK_H=triton.next_power_of_2(H_kv), BLOCK_D=triton.next_power_of_2(D),
        num_warps=4)
