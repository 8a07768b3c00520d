"""Triton ``oscar::attention``: paged attention over the INT-b history + full-precision windows.

One kernel serves decode and extend (prefill chunks). A program owns BLOCK_M new tokens of one
sequence and one KV head: its ROWS = BLOCK_M * g query rows (all query heads of the KV head, so
each K/V byte is loaded once for the whole GQA group) attend to
- the history (quantized pages), dequantized in registers: a code's bits are read as an fp16
  subnormal (one AND per two codes, no conversion: decode_plane), scale and zero folded into two
  multiply-adds per score and into the softmax weights (history_block); each block's page numbers
  and scales are loaded one block ahead. Masked INT2 pages (head_dim 128) are read as whole
  16-token blocks and decoded in their stored order (code_layout_triton, history_block);
- the sink + recent window slots and the chunk's own keys (causal), in full precision.
A layer kept at 16 bits beside INT-b layers (BITS = 16) has the same windows and a history of
rows as stored: its history blocks are the full-precision blocks of the windows.
Flash-decoding: with nsplit > 0 the grid's third axis splits the history into nsplit equal parts
per sequence, plus nwin programs for the windows (the last of them also takes the chunk); each
writes a normalised partial and its log-sum-exp, and merge_partials combines them. With
nsplit = 0 (many query blocks, e.g. prefill) one program does everything and writes the output.
Grid sizes and split counts come from tensor shapes only: no host sync, safe under CUDA graphs.
Deterministic mode (kernels.determinism) plans one launch shape for every batch instead
(attention_split_plan).
The chunk is never written to a BF16 copy of the prefix: history stays packed in the pools.
"""
from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from oscar_compile.formats.cache import code_layout
from oscar_compile.kernels.attention.attention_blocks_triton import (
    NEG_INIT,
    full_block,
    group_params,
    history_block,
    history_rows,
    merge_partials,
    page_rows,
    program_ids,
    query_rows,
    store_rows,
)
from oscar_compile.kernels.attention.attention_split_plan import deterministic_launch, merge_partials_in_order
from oscar_compile.kernels.determinism import split_tokens
from oscar_compile.kernels.device import interpreting, num_sms
from oscar_compile.kernels.layout.code_decode_triton import CODE_EXP, plane_factor
from oscar_compile.kernels.pools import FULL_PRECISION_BITS, attention_output_for

LOG2E = 1.4426950408889634
MAX_SPLIT_TOKENS = 8192
_log = logging.getLogger(__name__)
_ASM_FAILED = False


def _note_asm_failure() -> None:
    global _ASM_FAILED
    _ASM_FAILED = True
    _log.warning("bit-trick INT-b decode (inline PTX) failed to compile; using plain unpacking",
                 exc_info=True)


def launch_with_asm(launch, use_asm: bool | None, on_cuda: bool) -> None:
    """``launch(USE_ASM=...)``: with ``use_asm`` None, the bit-trick decode on a CUDA device
    (outside the interpreter), and plain unpacking if its inline PTX does not build there."""
    auto = use_asm is None
    if auto:
        use_asm = on_cuda and not interpreting() and not _ASM_FAILED
    try:
        launch(USE_ASM=use_asm)
    except Exception:  # the inline PTX did not build for this GPU / Triton: plain unpack instead
        if not (auto and use_asm):
            raise
        _note_asm_failure()
        launch(USE_ASM=False)


# B and nsplit stay specialized (1 / multiple of 16 / other): without, batch-1 decode measured up to
# 40 % slower on the H200 (2026-11-30). The runner compiles those variants at startup instead.
@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, cub_ptr, lens_ptr, hist_ptr, wt_ptr, qt_ptr,
    kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    out_ptr, po_ptr, pl_ptr, qk_scale, B, nsplit, nwin,
    sqn, sqh, skn, skh, svn, svh, stride_wt, stride_qt,
    H_KV: tl.constexpr, G_Q: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    SINK: tl.constexpr, RECENT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    SPLIT: tl.constexpr, WIN_SPLIT: tl.constexpr, USE_ASM: tl.constexpr, DOT_DT: tl.constexpr,
    HAS_HIST: tl.constexpr, MASKED: tl.constexpr, SPLIT_LEN: tl.constexpr,
):
    # planes of the accumulator: as the codes pack; a 16-bit history splits D in two, as the
    # full-precision kernel does
    NPL: tl.constexpr = 2 if BITS == 16 else 8 // BITS
    WP: tl.constexpr = D // NPL
    NG: tl.constexpr = D // GROUP
    # masked INT2 pages: the value accumulators hold each bit pair's channels (value_columns),
    # unless a quantization group splits them (G = 32); the key planes' codes come in the units of
    # their token's bit pair, so q keeps its scale (history_block)
    VMASKED: tl.constexpr = MASKED and GROUP > WP
    QB: tl.constexpr = 0 if MASKED else BITS
    pid, h, sid, i = program_ids(cub_ptr, B)
    if pid < tl.load(cub_ptr + B):
        start, T, L, t0, r, tok, head, row_ok, q_rows = query_rows(
            q_ptr, cu_ptr, cub_ptr, lens_ptr, pid, h, i, sqn, sqh, G_Q, BLOCK_M, ROWS)
        m = tl.zeros([ROWS], tl.float32) + NEG_INIT
        l = tl.zeros([ROWS], tl.float32)
        a0 = tl.zeros([ROWS, WP], tl.float32)
        a1 = tl.zeros([ROWS, WP], tl.float32)
        a2 = tl.zeros([ROWS, WP], tl.float32)
        a3 = tl.zeros([ROWS, WP], tl.float32)
        z0 = tl.zeros([ROWS], tl.float32)
        z1 = tl.zeros([ROWS], tl.float32)
        z2 = tl.zeros([ROWS], tl.float32)
        z3 = tl.zeros([ROWS], tl.float32)
        if HAS_HIST:
            n_hist = tl.load(hist_ptr + i)  # larger than standard after a prefix-cache hit
        else:
            n_hist = tl.maximum(L - SINK - RECENT, 0)
        # (split_range in attention_blocks_triton computes the same; through that helper this
        # kernel ran 15-30 % slower at batch 8-32 with fp16 scales on the H200, 2026-11-30)
        if SPLIT:
            do_hist = sid < nsplit
            do_win = sid >= nsplit
        else:
            do_hist = sid >= 0
            do_win = sid >= 0
        if do_hist:
            if not SPLIT:
                lo = n_hist * 0
                hi = n_hist
            else:
                if SPLIT_LEN > 0:  # deterministic mode: fixed parts from history position 0
                    chunk = SPLIT_LEN
                else:
                    chunk = tl.cdiv(tl.cdiv(n_hist, nsplit), BLOCK_N) * BLOCK_N
                lo = tl.minimum(sid * chunk, n_hist)
                hi = tl.minimum(lo + chunk, n_hist)
            qt_row = qt_ptr + i.to(tl.int64) * stride_qt
            if BITS == 16:  # a layer kept at 16 bits: history rows as stored
                qh = tl.load(q_rows + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
                qh = qh.to(DOT_DT)
                for n0 in range(lo, hi, BLOCK_N):
                    rowh, hmask = history_rows(qt_row, n0, hi, h, H_KV, P, BLOCK_N)
                    m, l, a0, a1, a2, a3, z0, z1, z2, z3 = full_block(
                        qh, m, l, a0, a1, a2, a3, z0, z1, z2, z3, kc_ptr, vc_ptr, rowh,
                        hmask[None, :] & (r[:, None] >= 0), D, D, qk_scale, D, WP, NPL, DOT_DT, VMASKED)
            else:
                c = tl.arange(0, WP)[None, :]
                qm = row_ok[:, None]
                q0 = tl.load(q_rows + c, mask=qm, other=0.0).to(tl.float16).to(tl.float32)
                q1 = tl.load(q_rows + WP + c, mask=qm, other=0.0).to(tl.float16).to(tl.float32)
                q2 = q0
                q3 = q1
                if NPL == 4:
                    q2 = tl.load(q_rows + 2 * WP + c, mask=qm, other=0.0).to(tl.float16).to(tl.float32)
                    q3 = tl.load(q_rows + 3 * WP + c, mask=qm, other=0.0).to(tl.float16).to(tl.float32)
                # sums of the (fp16-rounded) query over each quantization group, in the units of the
                # decoded codes (2^CODE_EXP, see decode_plane); qk_scale takes the inverse factor
                s0 = tl.sum(q0, axis=1) * plane_factor(CODE_EXP)
                s1 = tl.sum(q1, axis=1) * plane_factor(CODE_EXP)
                s2 = tl.sum(q2, axis=1) * plane_factor(CODE_EXP)
                s3 = tl.sum(q3, axis=1) * plane_factor(CODE_EXP)
                # plane i of q divided by plane i's code factor 2^(QB * i): q_i . codes_i then
                # comes out in the same units for every plane (exact unless q_i goes subnormal)
                q0 = q0.to(tl.float16)
                q1 = (q1 * plane_factor(-QB)).to(tl.float16)
                q2 = (q2 * plane_factor(-2 * QB)).to(tl.float16)
                q3 = (q3 * plane_factor(-3 * QB)).to(tl.float16)
                PPG: tl.constexpr = GROUP // WP  # planes per group: 1, 2 or 4
                if PPG == 1:
                    g0, g1, g2, g3 = s0, s1, s2, s3
                elif PPG == 2:
                    g0, g1, g2, g3 = s0 + s1, s2 + s3, s0, s0
                else:
                    g0 = s0 + s1 + s2 + s3
                    g1, g2, g3 = g0, g0, g0
                # each iteration loads the next block's page numbers and scales / zeros (the code
                # tiles Triton pipelines itself): waiting on them in the block that uses them was the
                # kernel's main stall (ncu on the H200, 2026-11-30)
                rowq, tmask = history_rows(qt_row, lo, hi, h, H_KV, P, BLOCK_N)
                ks, kz, vs, vz = group_params(ks_ptr, kz_ptr, vs_ptr, vz_ptr, rowq, tmask, NG)
                for n0 in range(lo, hi, BLOCK_N):
                    rowq_n, tmask_n = history_rows(qt_row, n0 + BLOCK_N, hi, h, H_KV, P, BLOCK_N)
                    ks_n, kz_n, vs_n, vz_n = group_params(ks_ptr, kz_ptr, vs_ptr, vz_ptr, rowq_n,
                                                          tmask_n, NG)
                    m, l, a0, a1, a2, a3, z0, z1, z2, z3 = history_block(
                        q0, q1, q2, q3, g0, g1, g2, g3, m, l, a0, a1, a2, a3, z0, z1, z2, z3,
                        kc_ptr, vc_ptr, ks, kz, vs, vz, rowq, tmask,
                        qk_scale * plane_factor(-CODE_EXP), ROWS, BLOCK_N, BITS, WP, GROUP, NG, NPL,
                        USE_ASM, MASKED, VMASKED, PROMOTE=BLOCK_M > 1)
                    rowq, tmask, ks, kz, vs, vz = rowq_n, tmask_n, ks_n, kz_n, vs_n, vz_n
                # the value accumulators hold plane i in units of its code factor (a0..a3 start at
                # zero, so the history is all they hold here)
                a0 = a0 * plane_factor(-CODE_EXP)
                a1 = a1 * plane_factor(-CODE_EXP - BITS)
                a2 = a2 * plane_factor(-CODE_EXP - 2 * BITS)
                a3 = a3 * plane_factor(-CODE_EXP - 3 * BITS)
        if do_win:
            kdt = DOT_DT
            d = tl.arange(0, D)[None, :]
            qf = tl.load(q_rows + d, mask=row_ok[:, None], other=0.0).to(kdt)
            # sink slots [0, min(L, S0)); the ring holds positions [S0 + h, L)
            n_sink = tl.minimum(L, SINK)
            n_rec = tl.maximum(L - SINK - n_hist, 0)
            wt_row = wt_ptr + i.to(tl.int64) * stride_wt
            # window program sid - nsplit of nwin takes a run of whole BLOCK_W blocks of the slots
            # (with one window program the loop keeps constant bounds: runtime ones measured 4-7 %
            # slower at batch 8-32, H200 2026-11-30)
            NWB: tl.constexpr = (SINK + RECENT + BLOCK_W - 1) // BLOCK_W
            if WIN_SPLIT:
                per = tl.cdiv(NWB, nwin)
                wlo = tl.minimum((sid - nsplit) * per, NWB) * BLOCK_W
                whi = tl.minimum(wlo + per * BLOCK_W, NWB * BLOCK_W)
                kend = tl.where(sid == nsplit + nwin - 1, tl.minimum(T, t0 + BLOCK_M), 0)
            else:
                wlo = 0
                whi = NWB * BLOCK_W
                kend = tl.minimum(T, t0 + BLOCK_M)
            for w0 in range(wlo, whi, BLOCK_W):
                w = w0 + tl.arange(0, BLOCK_W)
                ok = window_slot_ok(w, n_sink, n_hist, n_rec, SINK, RECENT)
                rows = page_rows(wt_row, w, ok, h, H_KV, P)
                key_ok = ok[None, :] & (r[:, None] >= 0)
                m, l, a0, a1, a2, a3, z0, z1, z2, z3 = full_block(
                    qf, m, l, a0, a1, a2, a3, z0, z1, z2, z3, kwin_ptr, vwin_ptr, rows, key_ok,
                    D, D, qk_scale, D, WP, NPL, kdt, VMASKED)
            # the chunk's own keys, causally (new token j visible to row tok iff j <= tok); in the
            # last window program
            for j0 in range(0, kend, BLOCK_C):
                j = j0 + tl.arange(0, BLOCK_C)
                key_ok = (j[None, :] <= tok[:, None]) & (j[None, :] < kend)
                rows = (start + j).to(tl.int64)
                m, l, a0, a1, a2, a3, z0, z1, z2, z3 = full_block(
                    qf, m, l, a0, a1, a2, a3, z0, z1, z2, z3, k_ptr + h * skh, v_ptr + h * svh,
                    rows, key_ok, skn, svn, qk_scale, D, WP, NPL, kdt, VMASKED)
        inv_l = tl.where(l > 0.0, 1.0 / l, 0.0)
        n_glob = (start + tok).to(tl.int64)
        if not SPLIT:
            base = out_ptr + (n_glob * (H_KV * G_Q) + head)[:, None] * D
            store_rows(base, row_ok, a0, a1, a2, a3, z0, z1, z2, z3, inv_l, WP, NPL, VMASKED)
        else:
            prow = (n_glob * (H_KV * G_Q) + head) * (nsplit + nwin) + sid
            store_rows(po_ptr + prow[:, None] * D, row_ok, a0, a1, a2, a3, z0, z1, z2, z3,
                       inv_l, WP, NPL, VMASKED)
            lse = tl.where(l > 0.0, m + tl.math.log2(l), float("-inf"))
            tl.store(pl_ptr + prow, lse, mask=row_ok)


# Prefill launches (BLOCK_M > 1) do not specialize B, nsplit and nwin: a server meets every
# combination of 1 / multiple of 16 / other, and each compile held its engine for 2-5 s (H200,
# 16 concurrent requests on the bundled model: 16 compiles after startup, run 14 in
# bench/results/2026-12-02-h200-serve-load); a prefill program's work dwarfs what specializing
# them saves.
attn_kernel_prefill = triton.jit(do_not_specialize=["B", "nsplit", "nwin"])(_attn_kernel.fn)


@triton.jit
def window_slot_ok(w, n_sink, n_hist, n_rec, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Which window slots w: [BLOCK_W] hold a cached token (n_rec ring tokens after n_hist history).

    Ring position S0 + n_hist + j (j in [0, n_rec), n_rec <= W) sits at ring index
    (n_hist + j) % W, so ring index r holds a token iff j = (r - n_hist) mod W < n_rec: a cyclic
    run of n_rec indices from n_hist % W. Standard state (n_hist = max(0, L - S0 - W)): either
    n_rec = W (every index) or n_hist = 0 and r < n_rec, the rule without history_lens.
    """
    ok = w < n_sink
    if RECENT > 0:
        j = (w - SINK + RECENT - n_hist % RECENT) % RECENT  # >= 0 on ring slots (w >= S0)
        ok = ok | ((w >= SINK) & (w < SINK + RECENT) & (j < n_rec))  # the last block pads past the ring
    return ok


def kernel_takes(H_q: int, H_kv: int, D: int, bits: int, group_size: int) -> bool:
    """Whether the kernel runs a call of these shapes (else its wrapper runs the reference):
    tl.dot needs power-of-two tiles of >= 16 channels per plane, and a plane must not straddle
    quantization groups."""
    full = bits == FULL_PRECISION_BITS
    wp = D // 2 if full else D * bits // 8
    return not (H_q % H_kv or D & (D - 1) or wp < 16 or (not full and group_size % wp))


def check_output(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` if it can take the call's output rows: q's shape and dtype, contiguous."""
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor on {q.device}")
    return out


def query_block_prefix(cu_seqlens: torch.Tensor, block_m: int, seq_mask: torch.Tensor | None = None):
    """[B + 1] int32: where each sequence's query blocks of ``block_m`` tokens start in the grid
    (programs past the last one return at once). ``seq_mask`` ([B] bool): the other sequences get
    no block, so their output rows are left alone."""
    per_seq = (cu_seqlens[1:] - cu_seqlens[:-1] + block_m - 1) // block_m
    if seq_mask is not None:
        per_seq = per_seq * seq_mask
    return torch.cat([cu_seqlens[:1] * 0, per_seq.cumsum(0)]).to(torch.int32)


def dot_dtype(window_dtype: torch.dtype):
    """Operand dtype of the full-precision dots: the window dtype, float32 in the interpreter
    (whose dot would multiply the raw bit patterns of bfloat16, which numpy lacks)."""
    if interpreting() or window_dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[window_dtype]


def plan_launch(N: int, B: int, H_kv: int, g: int, max_hist: int, device: torch.device,
                block_n: int = 64, min_split_blocks: int = 4,
                prefill_rows: int = 64) -> tuple[int, int, int]:
    """(BLOCK_M, ROWS, NSPLIT) from shapes only (no device values: CUDA-graph safe).

    Decode-like batches (about one token per sequence) take BLOCK_M = 1 and split the history
    into as many parts as fit the history programs into one wave of four per SM, each split at
    least ``min_split_blocks`` history blocks long; prefill-like batches take blocks of
    ``prefill_rows`` query rows and split only when the query blocks alone cannot fill the GPU.
    The count is then trimmed so that the planned length is a whole number of blocks per split
    (63 splits of a 254-block history leave 13 of them idle).
    Rounding the split count up instead, a few programs spill into a second wave that runs
    nearly alone: at batch 8 (64 programs per split on 528 slots), 9 splits against 8 took
    155 / 123 µs at 32k (INT2) and 350 / 256 µs for the paged BF16 kernel (H200, 2026-11-30).
    """
    sms = num_sms(device)
    if N <= 2 * B:
        block_m = 1
    else:
        block_m = max(1, prefill_rows // g)
    rows = max(16, triton.next_power_of_2(block_m * g))
    programs = (triton.cdiv(N, block_m) + (B if block_m > 1 else 0)) * H_kv
    # at most MAX_SPLIT_TOKENS per split: the value accumulator and its zero-point term nearly
    # cancel (see history_block), and float32 rounding grows with the length of one running sum
    precision_splits = triton.cdiv(max_hist, MAX_SPLIT_TOKENS) if max_hist > MAX_SPLIT_TOKENS else 0
    if max_hist == 0 or programs >= 2 * sms:
        # a full GPU needs no splits for speed; decode batches still take them for precision
        # (a prefill chunk's partials would take N * H_q * (nsplit + nwin) * D floats)
        return block_m, rows, precision_splits if block_m == 1 else 0
    min_tokens = min_split_blocks * block_n  # below this a split costs more in merging than it saves
    if max_hist <= min_tokens:
        return block_m, rows, 0
    blocks = triton.cdiv(max_hist, block_n)
    nsplit = min(max(1, 4 * sms // programs), max(1, blocks // min_split_blocks))
    nsplit = triton.cdiv(blocks, triton.cdiv(blocks, nsplit))
    return block_m, rows, max(nsplit, precision_splits)


def plan_window_splits(window_blocks: int, split_blocks: int) -> int:
    """Programs sharing the sink + recent windows of one (sequence, KV head) in a split launch:
    enough that none runs a longer chain of blocks than a history split (``split_blocks``).

    At batch 1 the window program (10 blocks for 320 slots) outlasted 2-4-block history splits.
    H200 sweep (bench.kernels variants, 2026-11-30): 8k / batch 1, 2 blocks per split: one window
    program 22.6 µs, two 15.1, five 12.1; 32k / batch 1, 4 blocks: one 28.4, two or three 22.5-23.0;
    128k / batch 1 (16 blocks) and batch 32: no gain.
    """
    return max(1, min(window_blocks, triton.cdiv(window_blocks, max(split_blocks, 1))))


def window_programs(window_slots: int, block_w: int, max_hist: int, block_n: int, nsplit: int) -> int:
    """plan_window_splits for a decode launch of nsplit history splits over max_hist slots."""
    split_blocks = triton.cdiv(triton.cdiv(max_hist, block_n), nsplit)
    return plan_window_splits(triton.cdiv(window_slots, block_w), split_blocks)


def history_block_n(bits: int, block_n: int = 128) -> int:
    """History keys per block of a launch: 64 at most for a 16-bit history, as the full-precision
    kernel takes (a 128 x D tile of 16-bit keys would not fit the register cap)."""
    return min(block_n, 64) if bits == FULL_PRECISION_BITS else block_n


def plan_triton_launch(N: int, B: int, H_kv: int, g: int, max_hist: int, device: torch.device, block_n: int,
                       window_slots: int, block_w: int = 32, prefill_rows: int = 64, nsplit: int | None = None,
                       win_splits: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M, ROWS, NSPLIT, NWIN) of one launch from shapes only (CUDA-graph safe): ``plan_launch``
    (in deterministic mode ``deterministic_launch``) and the programs sharing the windows;
    ``nsplit`` / ``win_splits`` override as ``attention_triton``'s do."""
    split_len = split_tokens()
    if split_len is not None:  # deterministic mode: one launch shape for every batch
        block_m, rows, nsplit = deterministic_launch(max_hist, g, split_len, block_n, prefill_rows)
    else:
        # splits of 2 history blocks: measured on the H200 (bench.kernels variants, 2026-11-30) the
        # best at batch 1 for 8k-128k; 4 blocks (the paged BF16 kernel's choice) was 10-20 % slower
        block_m, rows, planned = plan_launch(N, B, H_kv, g, max_hist, device, block_n, min_split_blocks=2,
                                             prefill_rows=prefill_rows)
        nsplit = planned if nsplit is None else nsplit
    nwin = 1
    if nsplit and win_splits:
        nwin = win_splits
    elif nsplit and block_m == 1 and split_len is None:  # (an extend chunk's own keys stay in one program)
        nwin = window_programs(window_slots, block_w, max_hist, block_n, nsplit)
    return block_m, rows, nsplit, nwin


def attention_triton(
    q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win,
    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, sink, recent, bits, group_size,
    history_lens=None, block_n: int = 128, use_asm: bool | None = None, num_warps: int = 4,
    num_stages: int = 2, nsplit: int | None = None, block_w: int = 32, maxnreg: int | None = 128,
    win_splits: int | None = None, prefill_rows: int = 64, prefill_maxnreg: int | None = None,
    seq_mask=None, out=None, launch_plan: tuple[int, int, int, int] | None = None,
):
    """Check, plan and launch. q: [N, H_q, D], k, v: [N, H_kv, D] -> [N, H_q, D] in q.dtype.

    ``history_lens``: [B] int32 history length per sequence, or None (standard). The grid does not
    depend on it (history splits are planned for the quant table's capacity), so it may change
    between replays of a captured CUDA graph. ``nsplit`` overrides the planned number of history
    splits, ``win_splits`` the number of programs sharing the windows (with nsplit > 0),
    ``block_w`` is the window block, ``prefill_rows`` the query rows of a prefill program
    (benchmark sweeps). ``maxnreg`` caps the registers per thread of decode launches: at 128,
    four 4-warp programs fit an SM; uncapped, Triton 3.6 took 139-140 and three fit, 15-25 %
    slower at batch 8-32 (H200, 2026-11-30). Prefill launches (``prefill_maxnreg``) stay
    uncapped: a 64-row program under the 128 cap spilled about 150 registers per history block
    (Triton 3.6, sm_90 SASS), uncapped it takes 255 and none.

    ``launch_plan``: (BLOCK_M, ROWS, NSPLIT, NWIN) as ``plan_triton_launch`` gives for this call
    (attention_dispatch's plan of the step), else planned here.

    ``seq_mask`` ([B] bool, on the device) computes only those sequences' rows, into ``out``
    ([N, H_q, D], given with it): another launch writes the other rows (the extend path,
    attention_extend_triton). Prefill-like launches without history splits only (a split
    launch's merge writes every row).
    """
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    B = cache_lens.shape[0]
    P = k_win.shape[2]
    full = bits == FULL_PRECISION_BITS  # a layer kept at 16 bits: history rows as stored
    if not kernel_takes(H_q, H_kv, D, bits, group_size):
        if seq_mask is not None:
            raise ValueError("seq_mask: a shape the kernel does not take (the reference computes every row)")
        from oscar_compile.kernels.attention.decode.attention_ref import attention_ref

        return attention_ref(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win,
                             v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
                             scale, sink, recent, bits, group_size, history_lens)
    if (seq_mask is None) != (out is None):
        raise ValueError("give seq_mask and out together")
    fresh = attention_output_for(q, k, v, (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero),
                                 history_lens, B, allocate=out is None)
    out = fresh if out is None else check_output(out, q)
    if N == 0:
        return out
    g = H_q // H_kv
    max_hist = quant_table.shape[1] * P
    masked = code_layout(bits, D, P) == "masked"
    if masked and block_n % 16:  # history tiles of whole 16-token blocks (history_block)
        raise ValueError(f"block_n must be a multiple of 16 over masked INT2 pages, got {block_n}")
    if full:
        # 64-key blocks, as the full-precision kernel takes: a 128 x D tile of 16-bit keys would
        # not fit the register cap. The window pools stand in for the empty scale / zero pools
        # (never read)
        block_n = history_block_n(bits, block_n)
        k_scale = k_zero = k_win
        v_scale = v_zero = v_win
    split_len = split_tokens()
    if split_len is not None and (seq_mask is not None or nsplit is not None or win_splits is not None):
        raise ValueError("deterministic mode plans its own launch (no seq_mask, nsplit or win_splits)")
    if launch_plan is None:
        launch_plan = plan_triton_launch(N, B, H_kv, g, max_hist, q.device, block_n, sink + recent, block_w,
                                         prefill_rows, nsplit, win_splits)
    block_m, rows, nsplit, nwin = launch_plan
    if seq_mask is not None and (block_m == 1 or nsplit):
        raise ValueError("seq_mask: prefill-like launches without history splits only")
    if block_m == 1:
        cub = cu_seqlens
        nblocks = N
    else:
        cub = query_block_prefix(cu_seqlens, block_m, seq_mask)
        nblocks = triton.cdiv(N, block_m) + B
    if nsplit:
        po = torch.empty(N * H_q * (nsplit + nwin), D, dtype=torch.float32, device=q.device)
        pl = torch.empty(N * H_q * (nsplit + nwin), dtype=torch.float32, device=q.device)
    else:
        po = pl = out
    # (a 16-bit history spills some registers under the cap, and still runs faster than uncapped,
    # as fast as attention_bf16: 264.6 / 356.1 / 264.4 µs at 32k, batch 8, H200 2026-11-30)
    cap = maxnreg if block_m == 1 else prefill_maxnreg
    launch = functools.partial(
        (_attn_kernel if block_m == 1 else attn_kernel_prefill)[(nblocks, H_kv, nsplit + nwin)],
        q, k, v, cu_seqlens, cub, cache_lens,
        history_lens if history_lens is not None else cache_lens, window_table, quant_table,
        k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero,
        out, po, pl, scale * LOG2E, B, nsplit, nwin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        window_table.stride(0), quant_table.stride(0),
        H_KV=H_kv, G_Q=g, D=D, P=P, SINK=sink, RECENT=recent, BITS=bits, GROUP=group_size,
        BLOCK_M=block_m, ROWS=rows, BLOCK_N=block_n,
        # window slots in 32-key blocks: 16 made the 320-slot window program the batch-1 critical
        # path, 64 raised the registers of the whole kernel (128k batch 1: 87 -> 140 us; H200 sweep)
        # the chunk's own keys in 16-key blocks for decode (T = 1), 64 for extend
        BLOCK_W=block_w, BLOCK_C=16 if block_m == 1 else 64,
        SPLIT=nsplit > 0, WIN_SPLIT=nwin > 1,
        DOT_DT=dot_dtype(k_win.dtype), HAS_HIST=history_lens is not None, SPLIT_LEN=split_len or 0,
        MASKED=masked,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": cap} if cap else {}),
    )
    launch_with_asm(launch, use_asm, q.is_cuda)
    if nsplit:
        merge = merge_partials_in_order if split_len is not None else merge_partials
        merge(po, pl, out, nsplit + nwin)
    return out
