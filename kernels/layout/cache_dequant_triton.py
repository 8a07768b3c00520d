"""Triton dequantization of each sequence's cache into dense full-precision pages (cache_dequant_ref).

One program per (scratch page, KV head) writes the keys and values of the P positions the page
holds (the run of pages it falls in names the sequence: seq_of_program), in position order:
sink and ring slots copied from the window pools, history rows dequantized from the planar
codes (masked INT2 pages: their 16-token blocks read whole, rebuilt into planar bytes in
registers, code_layout_triton; plane i
of a row's WP = D * b / 8 bytes holds channels [i WP, (i + 1) WP): one contiguous tile per
plane) with the scale and zero of
group c // G, s * (code - z) in float32 as ``quant.dequantize`` computes it, then rounded to the
window dtype. Bitwise the reference: the float32 value is the same product, and the rounding to
bfloat16 is done on the bits (round to nearest even), because the Triton interpreter's float32
-> bfloat16 cast truncates. Positions >= L are not written, nor any page outside the
sequence's run, whatever L says. Pages past a sequence's length return at once; the grid comes
from shapes only (the scratch's size).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.formats.cache import code_layout
from oscar_compile.kernels.attention.attention_blocks_triton import page_rows, seq_of_program, window_slot_of
from oscar_compile.kernels.layout.cache_dequant_ref import scratch_columns
from oscar_compile.kernels.layout.code_layout_triton import (
    load_masked_planar_bytes,
    load_planar_bytes,
    masked_block_rows,
)
from oscar_compile.kernels.pools import check_window_config
from oscar_compile.quant import SUPPORTED_BITS


@triton.jit
def round_to_bf16(x):
    """float32 -> bfloat16, round to nearest even, from the bits (finite x)."""
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant_rows(win_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, wrow, qrow, drow, in_win,
                  in_hist, ok, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                  ROUND_BF16: tl.constexpr, IS_KEY: tl.constexpr, MASKED: tl.constexpr):
    """Rows wrow (window pool) or qrow (history pools), [BLOCK_T] each, -> out rows drow, one
    plane (WP contiguous channels, one shift and mask of the packed bytes) at a time."""
    WP: tl.constexpr = D * BITS // 8
    NG: tl.constexpr = D // GROUP
    NPL: tl.constexpr = 8 // BITS
    j = tl.arange(0, WP)[None, :]
    hm = in_hist[:, None]
    if MASKED:  # the page's 16-token blocks, read whole (rows outside the history read page 0's first)
        blk = masked_block_rows(tl.where(in_hist, qrow, 0), qrow.shape[0])
        b = load_masked_planar_bytes(codes_ptr, blk, IS_KEY).to(tl.int32)  # [BLOCK_T, WP] planar
    else:
        b = load_planar_bytes(codes_ptr, qrow, in_hist, WP).to(tl.int32)
    for pl in tl.static_range(NPL):
        c = pl * WP + j  # the plane's channels
        w = tl.load(win_ptr + wrow[:, None] * D + c, mask=in_win[:, None], other=0.0)
        code = (b >> (BITS * pl)) & ((1 << BITS) - 1)
        g = qrow[:, None] * NG + c // GROUP
        s = tl.load(scale_ptr + g, mask=hm, other=0.0).to(tl.float32)
        z = tl.load(zero_ptr + g, mask=hm, other=0.0).to(tl.float32)
        x = s * (code.to(tl.float32) - z)
        if ROUND_BF16:
            xr = round_to_bf16(x)
        else:
            xr = x.to(out_ptr.dtype.element_ty)
        val = tl.where(hm, xr, w.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + drow[:, None] * D + c, val, mask=ok[:, None])


# B and the table strides (trimmed widths in the runtime's prefill steps) stay unspecialized
@triton.jit(do_not_specialize=["B", "stride_wt", "stride_qt"])
def _dequant_cache_kernel(
    lens_ptr, hist_ptr, runs_ptr, wt_ptr, qt_ptr, kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr,
    vs_ptr, vz_ptr, kout_ptr, vout_ptr, B, stride_wt, stride_qt,
    H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, SINK: tl.constexpr,
    RECENT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_HIST: tl.constexpr, ROUND_BF16: tl.constexpr, MASKED: tl.constexpr,
):
    s = tl.program_id(0)  # the scratch page
    h = tl.program_id(1)
    i = seq_of_program(runs_ptr, s, B)  # the run holding page s (B: past the last run)
    if i < B:
        t0 = (s - tl.load(runs_ptr + i)) * P  # the page's first position in sequence i
        L = tl.load(lens_ptr + i)
        if t0 < L:
            if HAS_HIST:
                n_hist = tl.load(hist_ptr + i)
            else:
                n_hist = tl.maximum(L - SINK - RECENT, 0)
            r = tl.arange(0, BLOCK_T)
            p = t0 + r
            ok = (r < P) & (p < L)
            in_hist = ok & (p >= SINK) & (p < SINK + n_hist)
            in_win = ok & ~in_hist
            slot = window_slot_of(p, SINK, RECENT)
            wrow = page_rows(wt_ptr + i.to(tl.int64) * stride_wt, slot, in_win, h, H_KV, P)
            qrow = page_rows(qt_ptr + i.to(tl.int64) * stride_qt, p - SINK, in_hist, h, H_KV, P)
            drow = (s.to(tl.int64) * H_KV + h) * P + r
            _dequant_rows(kwin_ptr, kc_ptr, ks_ptr, kz_ptr, kout_ptr, wrow, qrow, drow, in_win,
                          in_hist, ok, D, BITS, GROUP, ROUND_BF16, True, MASKED)
            _dequant_rows(vwin_ptr, vc_ptr, vs_ptr, vz_ptr, vout_ptr, wrow, qrow, drow, in_win,
                          in_hist, ok, D, BITS, GROUP, ROUND_BF16, False, MASKED)


def dequantize_cache_triton(cache_lens, window_table, quant_table, k_win, v_win, k_codes, k_scale,
                            k_zero, v_codes, v_scale, v_zero, sink, recent, bits, group_size,
                            history_lens=None, page_runs=None, num_pages: int | None = None,
                            num_warps: int = 2):
    """(k_pages [B * C, H_kv, P, D], v_pages, page_table [B, C]) as cache_dequant_ref says; rows
    of positions >= cache_lens[i] are left uninitialised. INT-b history only (b in 2, 4).

    ``page_runs`` ([B + 1] int32 on the device, non-decreasing from 0, with ``num_pages`` >= its
    last entry): sequence i's pages are instead ``page_runs[i] .. page_runs[i + 1] - 1`` of
    ``num_pages`` (an empty run: not decoded, its table row must not be read), at least
    ceil(L / P) of them for a decoded sequence (attention_extend_triton.plan_scratch). One
    program per scratch page and KV head: the grid is bounded by the scratch, not by B x C.
    """
    B, P = cache_lens.shape[0], k_win.shape[2]
    H, D = k_win.shape[1], k_win.shape[3]
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"dequantize_cache_triton decodes INT-b history (b in {SUPPORTED_BITS}), got bits {bits}")
    if D & (D - 1) or D % group_size:
        raise ValueError(f"head_dim {D} must be a power of two divisible by group_size {group_size}")
    if history_lens is not None and history_lens.shape != (B,):
        raise ValueError(f"history_lens must be [B] = [{B}], got {tuple(history_lens.shape)}")
    check_window_config(sink, recent, P)
    pools = (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero)
    if not all(t.is_contiguous() for t in pools):
        raise ValueError("the cache pools must be contiguous")
    cols = scratch_columns(window_table, quant_table)
    if (page_runs is None) != (num_pages is None):
        raise ValueError("give page_runs and num_pages together")
    if page_runs is None:  # sequence i owns pages i * C .. (i + 1) * C - 1 (scratch_page_table)
        page_runs = torch.arange(B + 1, dtype=torch.int32, device=k_win.device) * cols
        num_pages = B * cols
    elif page_runs.shape != (B + 1,) or page_runs.dtype != torch.int32:
        raise ValueError(f"page_runs must be [B + 1] = [{B + 1}] int32, got {tuple(page_runs.shape)} {page_runs.dtype}")
    table = page_runs[:-1, None] + torch.arange(cols, dtype=torch.int32, device=k_win.device)
    k_pages = torch.empty(num_pages, H, P, D, dtype=k_win.dtype, device=k_win.device)
    v_pages = torch.empty_like(k_pages)
    if num_pages == 0:
        return k_pages, v_pages, table
    _dequant_cache_kernel[(num_pages, H)](
        cache_lens, history_lens if history_lens is not None else cache_lens, page_runs, window_table,
        quant_table, *pools, k_pages, v_pages, B, window_table.stride(0), quant_table.stride(0),
        H_KV=H, D=D, P=P, SINK=sink, RECENT=recent, BITS=bits, GROUP=group_size,
        BLOCK_T=triton.next_power_of_2(P), HAS_HIST=history_lens is not None,
        ROUND_BF16=k_win.dtype == torch.bfloat16, MASKED=code_layout(bits, D, P) == "masked",
        num_warps=num_warps)
    return k_pages, v_pages, table


def compile_offline(window_dtype: str = "bf16", scale_dtype: str = "fp16", bits: int = 2,
                    group_size: int = 128, head_dim: int = 128, has_hist: bool = True,
                    page_size: int = 16, num_warps: int = 2):
    """Compile the kernel for sm_90 without a GPU (CI: it must build for the device, not only run
    in the interpreter). Returns Triton's compiled kernel (``.asm["ptx"]``, ``.metadata``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    wdt, sdt = window_dtype, scale_dtype
    ptrs = dict(lens_ptr="i32", hist_ptr="i32", runs_ptr="i32", wt_ptr="i32", qt_ptr="i32", kwin_ptr=wdt,
                vwin_ptr=wdt, kc_ptr="u8", ks_ptr=sdt, kz_ptr=sdt, vc_ptr="u8", vs_ptr=sdt, vz_ptr=sdt,
                kout_ptr=wdt, vout_ptr=wdt)
    sig = {name: f"*{t}" for name, t in ptrs.items()}
    sig.update(B="i32", stride_wt="i32", stride_qt="i32")
    consts = dict(H_KV=8, D=head_dim, P=page_size, SINK=64, RECENT=256, BITS=bits, GROUP=group_size,
                  BLOCK_T=triton.next_power_of_2(page_size), HAS_HIST=has_hist, ROUND_BF16=wdt == "bf16",
                  MASKED=code_layout(bits, head_dim, page_size) == "masked")
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}  # as the JIT specializes pointers
    src = ASTSource(_dequant_cache_kernel, sig, consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
