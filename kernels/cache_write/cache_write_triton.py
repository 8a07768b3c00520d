"""Fused Triton ``oscar::cache_write``: (rotate) + window write + demote/quantize + pack, one launch.

One program per (block of BLOCK_T new tokens, KV head, keys or values); each row is one new token
at position p = L + t of its sequence (found by counting cu_seqlens entries: no host sync,
CUDA-graph safe).
Per row at most one vector is quantized, which lets a single launch reach the state of
one-at-a-time writing (cache_write_ref) without a race:
- p < S0: the token goes to sink slot p;
- p >= L + T - W: the token goes to ring slot S0 + (p - S0) % W. It is that slot's last writer in
  this call, so this row also demotes the slot's old occupant p_old (the position in [L - W, L)
  congruent to p mod W, when p_old >= S0 + h): read before the slot is overwritten, quantized into
  history row p_old - S0. No other row touches that slot;
- otherwise (bulk prefill) the token is quantized straight into history row p - S0.
The ring holds positions [S0 + h, L) (h: ``history_lens``, or the standard max(0, L - W - S0)),
at most W of them, so S0 + h >= L - W. The old ring positions that must leave are
q in [S0 + h, min(L, L + T - W)); q + W >= L and q < L + T - W, so the unique position congruent
to q in [L + T - W, L + T) is a new ring token whose p_old is q: every leaving token is demoted
by exactly one row, and a slot whose p_old < S0 + h holds no token (after a prefix-cache hit, its
history row is already written and may be shared) and demotes nothing.
Tokens are rounded to the window dtype before quantization (what one-by-one writing stores).
A layer kept at 16 bits (BITS = 16) copies the demoted rows into its full-precision history.
Codes go into the pools in the layer's byte order (``formats.cache.code_layout``): planar rows,
or masked INT2 blocks (``code_layout_triton``), where a key row's bit pairs share 32-bit words
with 3 other tokens and are cleared and set with atomics (AND, then OR), so rows of one launch
(a bulk write's neighbours, a chunk edge, a hit start) and of earlier launches never clobber
one another, and no page needs zeroing when it is taken.
With ``rot_k`` the incoming keys are unrotated: k <- ((k - mean) @ rot).to(k.dtype) in float32
(``input_precision='ieee'``), matching ``oscar::rotate`` up to float32 summation order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.formats.cache import code_layout
from oscar_compile.kernels.attention.attention_blocks_triton import seq_of_rows, window_slot_of
from oscar_compile.kernels.cache_write.cache_write_ref import check_cache_write_args
from oscar_compile.kernels.layout.code_layout_triton import store_key_codes, store_value_codes
from oscar_compile.kernels.pools import FULL_PRECISION_BITS
from oscar_compile.kernels.quant.quant_triton import (
    clip_indices,
    clip_rows,
    quantize_codes,
    quantize_rows,
    zero_low_bits,
)


@triton.jit
def _write_one(x_new, old, x_ptr_win, codes_ptr, codes32_ptr, scale_ptr, zero_ptr, rows_win, win_mask, rows_q,
               quant_mask, demote, lo_idx, hi_idx, frac, CLIP: tl.constexpr, CLIP_LOW: tl.constexpr,
               BLOCK_T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               MASKED: tl.constexpr, IS_KEY: tl.constexpr):
    # x_new: [BLOCK_T, D] new tokens in the window dtype, old: the ring slots' occupants (loaded
    # by the caller);
    # rows_*: flat row indices into the pools
    d = tl.arange(0, D)[None, :]
    if BITS == 16:  # a layer kept at 16 bits: the row as it is, in the window dtype
        tl.store(codes_ptr + rows_q[:, None] * D + d, tl.where(demote[:, None], old, x_new),
                 mask=quant_mask[:, None])
    else:
        src = tl.where(demote[:, None], old, x_new).to(tl.float32)
        if CLIP:
            src = clip_rows(src, lo_idx, hi_idx, frac, CLIP_LOW)
        NG: tl.constexpr = D // GROUP
        g = tl.arange(0, NG)[None, :]
        if MASKED:  # INT2 at head_dim 128 in 16-token blocks (code_layout_triton)
            code, scale, zero = quantize_codes(src, BLOCK_T, D, BITS, GROUP, scale_ptr.dtype.element_ty)
            if IS_KEY:
                store_key_codes(codes32_ptr, rows_q, quant_mask, code, BLOCK_T)
            else:
                store_value_codes(codes_ptr, rows_q, quant_mask, code, BLOCK_T)
        else:
            packed, scale, zero = quantize_rows(src, BLOCK_T, D, BITS, GROUP, scale_ptr.dtype.element_ty)
            WP: tl.constexpr = D * BITS // 8
            c = tl.arange(0, WP)[None, :]
            tl.store(codes_ptr + rows_q[:, None] * WP + c, packed, mask=quant_mask[:, None])
        tl.store(scale_ptr + rows_q[:, None] * NG + g, scale, mask=quant_mask[:, None])
        tl.store(zero_ptr + rows_q[:, None] * NG + g, zero, mask=quant_mask[:, None])
    # every thread's read of the old ring value is done before any thread overwrites the slot
    tl.debug_barrier()
    tl.store(x_ptr_win + rows_win[:, None] * D + d, x_new, mask=win_mask[:, None])


@triton.jit(do_not_specialize=["N", "B"])  # one compile for every batch (Triton specializes 1 and multiples of 16)
def _cache_write_kernel(
    k_ptr, v_ptr, rot_ptr, mean_ptr, cu_ptr, lens_ptr, hist_ptr, wt_ptr, qt_ptr,
    kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, kc32_ptr,
    N, B, stride_kn, stride_kh, stride_vn, stride_vh, stride_wt, stride_qt,
    klo, khi, kfrac, vlo, vhi, vfrac,
    H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, CLIP_K: tl.constexpr, CLIP_V: tl.constexpr,
    HAS_ROT: tl.constexpr, HAS_MEAN: tl.constexpr, ROT_HEADS: tl.constexpr, HAS_HIST: tl.constexpr,
    BLOCK_T: tl.constexpr, CLIP_LOW: tl.constexpr, MASKED: tl.constexpr,
):
    h = tl.program_id(1) % H
    do_k = tl.program_id(1) < H  # program_id(1) // H picks the keys (0) or the values (1)
    n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] token rows
    valid = n < N
    n = tl.where(valid, n, 0)
    # a decode step (row n is sequence n's only token) needs no search: its cu entries and length
    # load at once; any other batch counts cu entries first, one more round of loads in the chain
    in_cu = n < B
    c0 = tl.load(cu_ptr + n, mask=in_cu, other=-1)
    c1 = tl.load(cu_ptr + n + 1, mask=in_cu, other=-1)
    L_n = tl.load(lens_ptr + n, mask=in_cu, other=0)
    one_each = ((c0 == n) & (c1 == n + 1)) | ~valid
    if tl.min(one_each.to(tl.int32), axis=0) == 1:
        seq = n
        start = n
        T = n * 0 + 1
        L = L_n
    else:
        seq = seq_of_rows(cu_ptr, n, B)
        start = tl.load(cu_ptr + seq)
        T = tl.load(cu_ptr + seq + 1) - start
        L = tl.load(lens_ptr + seq)
    p = L + (n - start)
    L_new = L + T
    to_sink = p < SINK
    to_ring = (~to_sink) & (p >= L_new - RECENT)
    to_hist = ~(to_sink | to_ring)
    if RECENT > 0:
        slot = window_slot_of(p, SINK, RECENT)
        p_old = p - RECENT * ((p - L + RECENT) // RECENT)  # in [L - W, L), same slot as p
        if HAS_HIST:
            ring_lo = SINK + tl.load(hist_ptr + seq)  # the ring holds [S0 + h, L)
        else:
            ring_lo = SINK  # standard: p_old >= L - W >= S0 + h as soon as p_old >= S0
        demote = to_ring & (p_old >= ring_lo) & valid
    else:
        slot = p
        p_old = p
        demote = to_ring & False
    h_pos = tl.where(demote, p_old, p) - SINK
    quant_mask = (to_hist & valid) | demote
    win_mask = (to_sink | to_ring) & valid
    wpage = tl.load(wt_ptr + seq * stride_wt + slot // P, mask=win_mask, other=0)
    rows_win = (wpage.to(tl.int64) * H + h) * P + slot % P
    qpage = tl.load(qt_ptr + seq * stride_qt + h_pos // P, mask=quant_mask, other=0)
    rows_q = (qpage.to(tl.int64) * H + h) * P + h_pos % P

    d = tl.arange(0, D)[None, :]
    if do_k:
        kin = tl.load(k_ptr + n[:, None] * stride_kn + h * stride_kh + d, mask=valid[:, None], other=0.0)
        if HAS_ROT:
            r = h // (H // ROT_HEADS)
            x = kin.to(tl.float32)
            if HAS_MEAN:
                x = x - tl.load(mean_ptr + r * D + d)
            e = tl.arange(0, D)
            rot = tl.load(rot_ptr + r * D * D + e[:, None] * D + e[None, :])  # [D, D] f32
            kin = tl.dot(x, rot, input_precision="ieee").to(k_ptr.dtype.element_ty)
        k_new = kin.to(kwin_ptr.dtype.element_ty)
        k_old = tl.load(kwin_ptr + rows_win[:, None] * D + d, mask=demote[:, None], other=0.0)
        _write_one(k_new, k_old, kwin_ptr, kc_ptr, kc32_ptr, ks_ptr, kz_ptr, rows_win, win_mask, rows_q,
                   quant_mask, demote, klo, khi, kfrac, CLIP_K, CLIP_LOW, BLOCK_T, D, BITS, GROUP, MASKED, True)
    else:
        vin = tl.load(v_ptr + n[:, None] * stride_vn + h * stride_vh + d, mask=valid[:, None], other=0.0)
        v_new = vin.to(vwin_ptr.dtype.element_ty)
        v_old = tl.load(vwin_ptr + rows_win[:, None] * D + d, mask=demote[:, None], other=0.0)
        _write_one(v_new, v_old, vwin_ptr, vc_ptr, vc_ptr, vs_ptr, vz_ptr, rows_win, win_mask, rows_q,
                   quant_mask, demote, vlo, vhi, vfrac, CLIP_V, CLIP_LOW, BLOCK_T, D, BITS, GROUP, MASKED, False)


def _check_pool_layout(pools) -> None:
    for t in pools:
        if not t.is_contiguous():
            raise ValueError("the cache pools must be contiguous (they are written in place)")


def cache_write_triton(
    k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win,
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
    sink, recent, bits, group_size, clip_k, clip_v, rot_k=None, mean_k=None, history_lens=None,
    block_t: int | None = None, fuse_rotation: bool = False, num_warps: int | None = None,
):
    """Check, then launch one program per (BLOCK_T tokens, KV head[, K or V]). Mutates the pools.

    The keys and the values have programs of their own: a decode step's write is a chain of
    dependent steps (find the sequence, page tables, old ring value, clip threshold,
    quantize, store), and two programs run the K and V chains side by side instead of one after
    the other (H200, 2026-11-30: batch 1 / 8 / 64 in 4.0 / 3.6 / 4.0 µs per layer with 4-row,
    4-warp programs; the kernel before, in another run, 5.9 / 4.7 / 4.9). ``block_t`` and
    ``num_warps`` are benchmark knobs.

    ``history_lens``: [B] int32 history length per sequence before the write, or None (standard).

    With ``rot_k`` and ``fuse_rotation=False`` (default) the keys are rotated by the torch
    reference (one float32 matmul, bitwise what ``oscar::rotate`` gives on the same device)
    before the launch. ``fuse_rotation=True`` does the rotation inside the kernel (interpreter
    tested); it is opt-in because it is slower: on the H200 (Triton 3.6, 2026-11-30) 29-31 µs per
    layer per decode step at batch 1-64, against 10-15 µs for the torch rotation plus the write.
    """
    if rot_k is not None and not fuse_rotation:
        from oscar_compile.kernels.elementwise.rotate_ref import rotate_ref

        k = rotate_ref(k.transpose(0, 1).unsqueeze(0), rot_k, mean_k).squeeze(0).transpose(0, 1)
        rot_k = mean_k = None
    check_cache_write_args(k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win,
                           k_codes, k_scale, sink, recent, bits, group_size, history_lens)
    pools = (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    _check_pool_layout(pools)
    if bits == FULL_PRECISION_BITS:  # no scale / zero: their (empty) pools are never read
        pools = (k_win, v_win, k_codes, k_win, k_win, v_codes, v_win, v_win)
    N, H, D = k.shape
    if N == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dim")
    if D & (D - 1):
        raise NotImplementedError(f"the Triton cache write needs a power-of-two head_dim, got {D}")
    if rot_k is not None:
        rot_k = rot_k.contiguous().float()
        mean_k = None if mean_k is None else mean_k.contiguous().float()
    if block_t is None:
        # decode steps: one row and one warp per program, the shortest chain (H200 sweep,
        # bench.kernels write-variants, 2026-11-30, µs per layer at batch 1 / 8 / 64: 3.1 / 3.2 /
        # 3.7, against 4.0 / 3.6 / 4.0 with 4 rows and 4 warps); prefill: 16 rows (H200: 83M
        # tokens/s against 77M with 8); the fused rotation's dot needs 16 rows.
        block_t = 16 if rot_k is not None or N >= 512 else 1
    if num_warps is None:
        num_warps = 1 if block_t == 1 else 4
    B = cache_lens.shape[0]
    masked = code_layout(bits, D, k_win.shape[2]) == "masked"
    klo, khi, kfrac = clip_indices(clip_k, D)
    vlo, vhi, vfrac = clip_indices(clip_v, D)
    dummy = k_win  # stands in for absent optional pointers (never read)
    _cache_write_kernel[(triton.cdiv(N, block_t), 2 * H)](
        k, v, rot_k if rot_k is not None else dummy, mean_k if mean_k is not None else dummy,
        cu_seqlens, cache_lens, history_lens if history_lens is not None else cache_lens,
        window_table, quant_table, *pools, pools[2].view(torch.int32) if masked else pools[2],
        N, B, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        window_table.stride(0), quant_table.stride(0), klo, khi, kfrac, vlo, vhi, vfrac,
        H=H, D=D, P=k_win.shape[2], SINK=sink, RECENT=recent, BITS=bits, GROUP=group_size,
        CLIP_K=clip_k < 1.0, CLIP_V=clip_v < 1.0, HAS_ROT=rot_k is not None,
        HAS_MEAN=mean_k is not None, ROT_HEADS=1 if rot_k is None else rot_k.shape[0],
        HAS_HIST=history_lens is not None,
        BLOCK_T=block_t, CLIP_LOW=min(zero_low_bits(k_win.dtype), zero_low_bits(v_win.dtype)), MASKED=masked,
        num_warps=num_warps, enable_fp_fusion=False,
    )


def compile_offline(bits: int = 2, head_dim: int = 128, page_size: int = 16, block_t: int = 1,
                    num_warps: int = 1, has_hist: bool = True):
    """Compile the write for sm_90 without a GPU (CI: the masked INT2 rows' reshapes and atomics
    must build for the device, not only run in the interpreter). bf16 windows, fp16 scales, the
    clip on; returns Triton's compiled kernel (``.asm["ptx"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = dict(k_ptr="bf16", v_ptr="bf16", rot_ptr="bf16", mean_ptr="bf16", cu_ptr="i32", lens_ptr="i32",
                hist_ptr="i32", wt_ptr="i32", qt_ptr="i32", kwin_ptr="bf16", vwin_ptr="bf16", kc_ptr="u8",
                ks_ptr="fp16", kz_ptr="fp16", vc_ptr="u8", vs_ptr="fp16", vz_ptr="fp16", kc32_ptr="i32")
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig.update({name: "i32" for name in ("N", "B", "stride_kn", "stride_kh", "stride_vn", "stride_vh",
                                         "stride_wt", "stride_qt", "klo", "khi")})
    sig.update(kfrac="fp32", vlo="i32", vhi="i32", vfrac="fp32")
    consts = dict(H=8, D=head_dim, P=page_size, SINK=64, RECENT=256, BITS=bits, GROUP=head_dim, CLIP_K=True,
                  CLIP_V=True, HAS_ROT=False, HAS_MEAN=False, ROT_HEADS=1, HAS_HIST=has_hist, BLOCK_T=block_t,
                  CLIP_LOW=16, MASKED=code_layout(bits, head_dim, page_size) == "masked")
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}
    src = ASTSource(_cache_write_kernel, sig, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})
