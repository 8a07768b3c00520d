"""The band pre-pass of decode-consistent prefill: the only keys whose precision depends on the row.

A chunk of T tokens at positions [L, L + T) reads every key below ``chunk_start - W`` quantized,
for every row: those sit in the INT-b pages already and the attention kernel reads them there.
Only the band ``[band_lo, L + T)``, ``band_lo = min(L, S0 + h)`` (the ring's old tokens and the
chunk; at most W + T positions), is read at window precision by some rows and quantized by
others. This pass writes both versions of the band, for keys and values, in the attention dots'
operand dtype:

- ``exact``: the ring tokens as stored, the chunk's tokens rounded to the window dtype;
- ``hist``: positions >= S0 quantized exactly as ``cache_write_ref`` demotes them (the
  ``quant_triton`` device functions, bit-exact: clip, scale and zero rounded to the scale dtype,
  codes round half to even) and dequantized as ``s * (code - z)`` in float32, the expression the
  attention kernel applies to the stored pages, so a position reads the same operand whether it
  comes from a page (a later chunk) or from here (deterministic mode relies on it).

Layout: sequence i's band rows start at ``bcu[i] = cu[i] + i W`` and row ``bcu[i] + s - (L - W)``
holds position s, so the buffer has ``N + B W`` rows, fixed by shapes: no host sync, the launch
can be captured in a CUDA graph. Rows below band_lo, and the rows of a sequence with no new token
(the decode rows of a mixed step: their queries go to the decode kernel), are left unwritten and
never read: in an 8192-token step beside 31 decode rows, writing their windows took as long as the
chunk's band (H100, bench/results/2026-12-07-gpu-int2-prefill-step, call b: 8.0 against 4.1 ms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.kernels.attention.attention_blocks_triton import seq_of_rows, window_slot_of
from oscar_compile.kernels.quant.quant_triton import clip_indices, clip_rows, quantize_codes, to_bf16_rne, zero_low_bits


@triton.jit
def _band_rows(x, out_e, out_h, rows, ok, is_hist, lo_idx, hi_idx, frac, BITS: tl.constexpr, GROUP: tl.constexpr,
               CLIP: tl.constexpr, CLIP_LOW: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
               SCALE_DT: tl.constexpr):  # fmt: skip
    """Store x [BLOCK_T, D] (window-dtype values as float32) and its history version."""
    d = tl.arange(0, D)[None, :]
    tl.store(out_e + rows[:, None] * D + d, x.to(out_e.dtype.element_ty), mask=ok[:, None])
    if BITS == 16:
        hist = x
    else:
        src = x
        if CLIP:
            src = clip_rows(src, lo_idx, hi_idx, frac, CLIP_LOW)
        NG: tl.constexpr = D // GROUP
        code, scale, zero = quantize_codes(src, BLOCK_T, D, BITS, GROUP, SCALE_DT)
        s32 = tl.reshape(tl.broadcast_to(scale.to(tl.float32)[:, :, None], (BLOCK_T, NG, GROUP)), (BLOCK_T, D))
        z32 = tl.reshape(tl.broadcast_to(zero.to(tl.float32)[:, :, None], (BLOCK_T, NG, GROUP)), (BLOCK_T, D))
        hist = s32 * (code.to(tl.float32) - z32)
    tl.store(out_h + rows[:, None] * D + d, hist.to(out_h.dtype.element_ty), mask=(ok & is_hist)[:, None])


@triton.jit(do_not_specialize=["B"])
def _band_kernel(
    k_ptr, v_ptr, cu_ptr, bcu_ptr, lens_ptr, hist_ptr, wt_ptr, kwin_ptr, vwin_ptr,
    ke_ptr, kh_ptr, ve_ptr, vh_ptr, B, skn, skh, svn, svh, stride_wt,
    klo, khi, kfrac, vlo, vhi, vfrac,
    H: tl.constexpr, D: tl.constexpr, P: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, CLIP_K: tl.constexpr, CLIP_V: tl.constexpr,
    HAS_HIST: tl.constexpr, BLOCK_T: tl.constexpr, CLIP_LOW: tl.constexpr, SCALE_DT: tl.constexpr,
    WIN_BF16: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(1) % H
    do_k = tl.program_id(1) < H
    n = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # band rows
    in_use = n < tl.load(bcu_ptr + B)
    n = tl.where(in_use, n, 0)
    seq = seq_of_rows(bcu_ptr, n, B)
    start = tl.load(cu_ptr + seq)
    L = tl.load(lens_ptr + seq)
    if HAS_HIST:
        n_hist = tl.load(hist_ptr + seq)
    else:
        n_hist = tl.maximum(L - RECENT - SINK, 0)
    s = L - RECENT + (n - tl.load(bcu_ptr + seq))  # the row's position
    # a sequence without new tokens (a mixed step's decode rows, which the decode kernel attends)
    # has no query to read its band
    has_new = tl.load(cu_ptr + seq + 1) > start
    ok = in_use & has_new & (s >= tl.minimum(L, SINK + n_hist))
    if tl.max(ok.to(tl.int32), axis=0) == 0:
        return
    is_new = ok & (s >= L)
    is_ring = ok & (s < L)
    slot = window_slot_of(tl.where(is_ring, s, 0), SINK, RECENT)
    wpage = tl.load(wt_ptr + seq * stride_wt + slot // P, mask=is_ring, other=0)
    rows_win = (wpage.to(tl.int64) * H + h) * P + slot % P
    tok = (start + s - L).to(tl.int64)
    rows = n.to(tl.int64) * H + h
    d = tl.arange(0, D)[None, :]
    is_hist = s >= SINK
    if do_k:
        x = tl.load(k_ptr + tok[:, None] * skn + h * skh + d, mask=is_new[:, None], other=0.0).to(tl.float32)
        if WIN_BF16:  # round to the window dtype (the interpreter's cast truncates)
            x = to_bf16_rne(x).to(tl.float32)
        else:
            x = x.to(kwin_ptr.dtype.element_ty).to(tl.float32)
        x += tl.load(kwin_ptr + rows_win[:, None] * D + d, mask=is_ring[:, None], other=0.0).to(tl.float32)
        _band_rows(x, ke_ptr, kh_ptr, rows, ok, is_hist, klo, khi, kfrac, BITS, GROUP, CLIP_K, CLIP_LOW, BLOCK_T, D,
                   SCALE_DT)  # fmt: skip
    else:
        x = tl.load(v_ptr + tok[:, None] * svn + h * svh + d, mask=is_new[:, None], other=0.0).to(tl.float32)
        if WIN_BF16:
            x = to_bf16_rne(x).to(tl.float32)
        else:
            x = x.to(vwin_ptr.dtype.element_ty).to(tl.float32)
        x += tl.load(vwin_ptr + rows_win[:, None] * D + d, mask=is_ring[:, None], other=0.0).to(tl.float32)
        _band_rows(x, ve_ptr, vh_ptr, rows, ok, is_hist, vlo, vhi, vfrac, BITS, GROUP, CLIP_V, CLIP_LOW, BLOCK_T, D,
                   SCALE_DT)  # fmt: skip


def band_cu(cu_seqlens: torch.Tensor, recent: int) -> torch.Tensor:
    """[B + 1] int32 first band row of each sequence (``cu[i] + i W``), on the device: no sync."""
    steps = torch.arange(cu_seqlens.shape[0], device=cu_seqlens.device, dtype=torch.int32)
    return (cu_seqlens + steps * recent).to(torch.int32)


def write_band(k, v, cu_seqlens, bcu, cache_lens, history_lens, window_table, k_win, v_win, scale_dtype,
               sink, recent, bits, group_size, clip_k, clip_v, dtype, block_t: int = 16):  # fmt: skip
    """(k_exact, k_hist, v_exact, v_hist): [N + B W, H_kv, D] in ``dtype``, rows laid out as the
    module docstring says. k, v: [N, H_kv, D] the chunk's tokens as passed."""
    N, H, D = k.shape
    B = cache_lens.shape[0]
    bufs = [torch.empty(N + B * recent, H, D, dtype=dtype, device=k.device) for _ in range(4)]
    if N + B * recent == 0:
        return bufs
    klo, khi, kfrac = clip_indices(clip_k, D)
    vlo, vhi, vfrac = clip_indices(clip_v, D)
    sdt = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[scale_dtype]
    _band_kernel[(triton.cdiv(N + B * recent, block_t), 2 * H)](
        k, v, cu_seqlens, bcu, cache_lens, history_lens if history_lens is not None else cache_lens,
        window_table, k_win, v_win, *bufs, B, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        window_table.stride(0), klo, khi, kfrac, vlo, vhi, vfrac,
        H=H, D=D, P=k_win.shape[2], SINK=sink, RECENT=recent, BITS=bits, GROUP=group_size,
        CLIP_K=clip_k < 1.0, CLIP_V=clip_v < 1.0, HAS_HIST=history_lens is not None, BLOCK_T=block_t,
        CLIP_LOW=min(zero_low_bits(k_win.dtype), zero_low_bits(v_win.dtype)), SCALE_DT=sdt,
        WIN_BF16=k_win.dtype == torch.bfloat16, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return bufs


def compile_offline(num_warps: int = 4, block_t: int = 16):
    """Compile the pre-pass for sm_90 without a GPU (CI: the early exit of sequences without new
    tokens and the quantizer must build for the device, not only run in the interpreter). The 8B
    layer's shapes, bf16 windows and band, fp16 scales, the clip on; returns Triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptrs = dict(k_ptr="bf16", v_ptr="bf16", cu_ptr="i32", bcu_ptr="i32", lens_ptr="i32", hist_ptr="i32",
                wt_ptr="i32", kwin_ptr="bf16", vwin_ptr="bf16", ke_ptr="bf16", kh_ptr="bf16", ve_ptr="bf16",
                vh_ptr="bf16")
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig.update({name: "i32" for name in ("B", "skn", "skh", "svn", "svh", "stride_wt", "klo", "khi", "vlo", "vhi")})
    sig.update(kfrac="fp32", vfrac="fp32")
    consts = dict(H=8, D=128, P=16, SINK=64, RECENT=256, BITS=2, GROUP=128, CLIP_K=True, CLIP_V=True, HAS_HIST=True,
                  BLOCK_T=block_t, CLIP_LOW=16, SCALE_DT=tl.float16, WIN_BF16=True)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}
    return triton.compile(ASTSource(_band_kernel, sig, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})
