"""Gluon ``oscar::attention`` for Hopper (sm_90): paged INT2 / INT4 decode with wgmma, A from registers.

Why Gluon: plain Triton chooses register layouts itself, so the decoded codes went through
shared memory and 4 query heads were padded to a 16-row tile (kernels/attention/decode/attention_triton.py,
stalled at about 2x cuDNN BF16). Here the layouts are explicit:

- **Keys on the M side, query heads on N** (N = 8 for GQA 1 / 4 / 8). One warpgroup (4 warps)
  takes 64 history tokens per step: S^T[64, N] = C[64, D] . q'^T[D, N], with C the key codes
  decoded straight into the wgmma A fragment (``convert_layout(..., assert_trivial=True)``: no
  data moves between threads). Thread (warp w, lane 4 g + t) reads bytes ``[t WP/4, (t + 1) WP/4)``
  of the planar key rows of tokens ``16 w + g`` and ``16 w + g + 8`` from the step's
  shared-memory stage: one 8-byte read each (INT2, D = 128).
- **It reads planar code rows** (docs/cache-format.md; INT4, and INT2 at head_dim 64: INT2 at
  head_dim 128 is masked since cache format version 2, ``CODE_LAYOUTS_READ``): the contraction index of the
  key dot is a permutation of the channels, kappa = 16 (mu + n_mu p) + 8 i0 + 2 t + e for the
  code of channel WP p + 4 n_mu t + 4 mu + 2 i0 + e (plane p, byte t WP/4 + 4 mu + 2 i0 + e),
  so the query is loaded in that order, once per program (``_kappa_channel``).
- **Codes decode as fp16 subnormals** (as attention_blocks_triton._dequant_asm): two byte permutes
  and one AND per 2 codes give c * 2^(b p - 24) exactly; 2^(-b p) is folded into q, 2^24 into
  the scores. Per-token scale and zero (one group per token) leave the inner loop:
  q . k = s (q' . c) - s z sum(q).
- **Values on the M side too**: O^T[D, N] += V^T[D, 64] . P'^T[64, N] with P' = P s_v in
  shared memory (fp16) and the zero term sum_t P'_t z_t kept per thread and reduced once at the
  end. Thread (warp w, lane 4 g + t) takes one byte column of the planar value rows of 16 tokens
  (tokens 16 v + 8 b + 2 t + e): its four channels (planes) are the fragment's rows
  ``channel = j + WP (a + 2 r)`` (INT2, D = 128; INT4 takes two byte columns j, j + 32 of two
  planes each; ``_value_channel``), so output rows are permuted channels, written back in
  channel order.
- **The history streams through shared memory** (``_copy_step`` / ``_read_step``): each 64-token
  step is copied with cp.async into one of STAGES stages, STAGES steps ahead of the math; warp w
  copies the step's 16-token block w (contiguous in the pools), so a thread makes one page lookup
  per step, a step earlier still. Register loads issued at the top of each step left the kernel
  waiting on memory at 35 % of HBM (run 9: removing a sixth of its instructions gained nothing);
  the pipeline took it to 48 % (run 10, bench/results/2026-12-01-h200-gluon-pipeline).
- **Online softmax across the warpgroup**: the running max is reduced over the 64 keys each step
  (shuffles within each warp, then one exchange of the four warp maxima through shared memory);
  the sums l and the zero terms stay per thread and are reduced once.
- **Flash-decoding**: the grid's third axis takes ``nsplit`` equal history parts (whole 64-token
  tiles) plus ``nwin`` programs for the BF16 sink + recent windows (the last one also takes the
  token's own chunk, causally); each writes a normalised partial and its log2-sum-exp and
  ``merge_partials`` (Triton) combines them. Grid and plan come from tensor shapes only: CUDA
  graph safe.

Scope (``gluon_supported``): sm_90, decode-like batches (at most 2 tokens per sequence, as the
Triton kernel's one-token programs), INT2 or INT4 (two planes per byte: the same fragments,
``BITS``), D in {64, 128}, one scale group per token
(G = D), pages of a multiple of 16 tokens, 16-bit windows, at most 32 query heads per KV head.
Every other case runs the Triton kernel (kernels/attention/attention_dispatch.py chooses).
"""
from __future__ import annotations

import triton

from oscar_compile.formats.cache import CACHE_FORMAT_VERSION, code_layout
from oscar_compile.kernels.attention.attention_blocks_triton import merge_partials
from oscar_compile.kernels.attention.decode import gluon_host
from oscar_compile.kernels.attention.decode.attention_gluon_tiles import (
    NEG_INIT,
    TILE,
    TILE_TOKENS,
    _allocate_history_stages,
    _block_pages,
    _copy_step,
    _kappa_channel,
    _key_operand,
    _mma_layout,
    _pow2,
    _read_step,
    _rows_layout,
    _slot_ok,
    _softmax_step,
    _store_partial,
    _token_state,
    _value_channel,
    _value_operand,
)
from oscar_compile.kernels.attention.decode.attention_triton import LOG2E, MAX_SPLIT_TOKENS, plan_window_splits
from oscar_compile.kernels.device import num_sms
from oscar_compile.kernels.gluon_compat import (
    fence_async_shared,
    gl,
    gluon,
    thread_barrier,
    wait_group,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _history_part(q_row, sqh, qt_row, kvh, lo, hi, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                  q_smem, p_smem, red_smem, qk_scale, H_KV: gl.constexpr, G_Q: gl.constexpr, NH: gl.constexpr,
                  D: gl.constexpr, P: gl.constexpr, WP: gl.constexpr, X: gl.constexpr,
                  STAGES: gl.constexpr, BITS: gl.constexpr):
    """History tokens [lo, hi): (o^T [D, N] in value-row order, m, l, zero term) of one split."""
    mma: gl.constexpr = _mma_layout(NH)
    ql: gl.constexpr = _rows_layout(D)
    # the query in contraction order, each plane divided by its code factor 2^(2 p), fp16
    qh = gl.arange(0, NH, layout=gl.SliceLayout(1, ql))
    kap = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    qv = gl.load(q_row + gl.expand_dims(qh * sqh, 1) + gl.expand_dims(_kappa_channel(kap, WP), 0),
                 mask=gl.expand_dims(qh < G_Q, 1), other=0.0).to(gl.float16).to(gl.float32)
    qsum = gl.convert_layout(gl.sum(qv, axis=1), gl.SliceLayout(0, mma))
    q_smem.store((qv * gl.expand_dims(_pow2(-BITS * (kap // WP)), 0)).to(gl.float16))
    fence_async_shared()
    thread_barrier()  # here, once: else Triton's barrier insertion puts one in every step
    qk = qk_scale * 16777216.0  # the decoded codes carry 2^-24
    m_i = gl.full([NH], NEG_INIT, gl.float32, layout=gl.SliceLayout(0, mma))
    l_part = gl.zeros([TILE, NH], gl.float32, layout=mma)
    z_part = gl.zeros([TILE, NH], gl.float32, layout=mma)
    o = gl.zeros([D, NH], gl.float32, layout=mma)
    kbuf, vbuf, sbuf = _allocate_history_stages(kc_ptr, vc_ptr, ks_ptr, STAGES, WP, X)
    # prologue: steps 0 .. STAGES - 1 in flight, the page of step STAGES in registers
    page, blk, live = _block_pages(lo, hi, qt_row, P, WP // 4)
    for j in gl.static_range(STAGES):
        _copy_step(kbuf, vbuf, sbuf, j, page, blk, live, kvh, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                   H_KV, P, WP, X)
        page, blk, live = _block_pages(lo + (j + 1) * TILE, hi, qt_row, P, WP // 4)
    step = 0
    for n0 in range(lo, hi, TILE):
        wait_group(STAGES - 1)  # this step's copies are done (this thread's) ...
        thread_barrier()  # ... and every thread's, visible to all warps
        stage = step % STAGES
        kb, vb, ks, kz, vs, vz, ok = _read_step(kbuf, vbuf, sbuf, stage, n0, hi, WP, X, NH)
        step += 1
        # the key dot runs while the value codes decode
        acc = warpgroup_mma(_key_operand(kb, D, WP, NH, BITS), q_smem.permute((1, 0)),
                            gl.zeros([TILE, NH], gl.float32, layout=mma), is_async=True)
        a_v = _value_operand(vb, D, X, NH, BITS)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # per row a = qk s and b = a z 2^-24, so each score is one multiply and one fma
        a = ks * qk
        b = a * kz * 5.9604644775390625e-08
        s = gl.expand_dims(a, 1) * acc - gl.expand_dims(b, 1) * gl.expand_dims(qsum, 0)
        s = gl.where(gl.expand_dims(ok, 1), s, float("-inf"))
        p, alpha, m_i, l_part = _softmax_step(s, m_i, l_part, red_smem, NH)
        # every warp has read this stage (the max exchange ends in a barrier): it takes the step
        # STAGES ahead, here rather than at the top of the loop, where Triton's barrier insertion
        # would add a barrier between the copies and the reads of the next stage
        _copy_step(kbuf, vbuf, sbuf, stage, page, blk, live, kvh, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                   H_KV, P, WP, X)
        page, blk, live = _block_pages(n0 + (STAGES + 1) * TILE, hi, qt_row, P, WP // 4)
        pv = (p * gl.expand_dims(vs, 1)).to(gl.float16)
        z_part = z_part * gl.expand_dims(alpha, 0) + pv.to(gl.float32) * gl.expand_dims(vz, 1)
        p_smem.store(pv)
        fence_async_shared()
        # (left running into the next tile, the accumulator of an empty split would reach the
        # wait defined by plain moves, and ptxas then serializes every wgmma of the kernel)
        o = warpgroup_mma(a_v, p_smem, o * gl.expand_dims(alpha, 0), is_async=True)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    wait_group(0)  # no copy may outlive the program (the last STAGES steps are past hi: masked)
    return o, m_i, gl.sum(l_part, axis=0), gl.sum(z_part, axis=0)


# ------------------------------------------------------------------ the 16-bit windows and the chunk
@gluon.jit
def _full_tile(k_rows, v_rows, ok, q_smem, kv_smem, p_smem, red_smem, o, m_i, l_part, qk_scale,
               D: gl.constexpr, NH: gl.constexpr):
    """Attend to 64 full-precision tokens (row pointers k_rows, v_rows: [64], masked by ok). The
    keys, then the values, pass through one shared-memory tile (a second one would cost the
    history programs occupancy: shared memory is allocated for the whole kernel)."""
    mma: gl.constexpr = _mma_layout(NH)
    rl: gl.constexpr = _rows_layout(D)
    d = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, rl)), 0)
    okr = gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, rl)), 1)
    kt = gl.load(gl.expand_dims(gl.convert_layout(k_rows, gl.SliceLayout(1, rl)), 1) + d, mask=okr, other=0.0)
    vt = gl.load(gl.expand_dims(gl.convert_layout(v_rows, gl.SliceLayout(1, rl)), 1) + d, mask=okr, other=0.0)
    kv_smem.store(kt.to(kv_smem.dtype))
    fence_async_shared()
    acc = warpgroup_mma(kv_smem, q_smem.permute((1, 0)), gl.zeros([TILE, NH], gl.float32, layout=mma),
                        is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    s = gl.where(gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, mma)), 1), acc * qk_scale,
                 float("-inf"))
    p, alpha, m_i, l_part = _softmax_step(s, m_i, l_part, red_smem, NH)
    p_smem.store(p.to(p_smem.dtype))
    kv_smem.store(vt.to(kv_smem.dtype))
    fence_async_shared()
    o = warpgroup_mma(kv_smem.permute((1, 0)), p_smem, o * gl.expand_dims(alpha, 0), is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
    return o, m_i, l_part


@gluon.jit
def _window_part(q_row, sqh, wt_row, kvh, widx, nwin, L, n_hist, t, kw_ptr, vw_ptr, kn_ptr, vn_ptr,
                 skn, svn, q_smem, kv_smem, p_smem, red_smem, qk_scale, H_KV: gl.constexpr,
                 G_Q: gl.constexpr, NH: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
                 SINK: gl.constexpr, RECENT: gl.constexpr):
    """Window program widx of nwin: its share of the sink + recent slots; the last one also the
    chunk's own keys 0..t (causal). -> (o^T [D, N] in channel order, m, l)."""
    mma: gl.constexpr = _mma_layout(NH)
    ql: gl.constexpr = _rows_layout(D)
    vec: gl.constexpr = gl.SliceLayout(1, mma)
    qh = gl.arange(0, NH, layout=gl.SliceLayout(1, ql))
    qd = gl.arange(0, D, layout=gl.SliceLayout(0, ql))
    qv = gl.load(q_row + gl.expand_dims(qh * sqh, 1) + gl.expand_dims(qd, 0),
                 mask=gl.expand_dims(qh < G_Q, 1), other=0.0)
    q_smem.store(qv.to(q_smem.dtype))
    fence_async_shared()
    m_i = gl.full([NH], NEG_INIT, gl.float32, layout=gl.SliceLayout(0, mma))
    l_part = gl.zeros([TILE, NH], gl.float32, layout=mma)
    o = gl.zeros([D, NH], gl.float32, layout=mma)
    n_sink = gl.minimum(L, SINK)
    n_rec = gl.maximum(L - SINK - n_hist, 0)
    NWB: gl.constexpr = (SINK + RECENT + TILE - 1) // TILE
    per = (NWB + nwin - 1) // nwin
    wlo = gl.minimum(widx * per, NWB) * TILE
    whi = gl.minimum(wlo + per * TILE, NWB * TILE)
    r = gl.arange(0, TILE, layout=vec)
    for w0 in range(wlo, whi, TILE):
        w = w0 + r
        ok = _slot_ok(w, n_sink, n_hist, n_rec, SINK, RECENT)
        page = gl.load(wt_row + w // P, mask=ok, other=0)
        row = ((page.to(gl.int64) * H_KV + kvh) * P + w % P) * D
        o, m_i, l_part = _full_tile(kw_ptr + row, vw_ptr + row, ok, q_smem, kv_smem, p_smem,
                                    red_smem, o, m_i, l_part, qk_scale, D, NH)
    kend = gl.where(widx == nwin - 1, t + 1, 0)
    for j0 in range(0, kend, TILE):
        j = j0 + r
        ok = j < kend
        o, m_i, l_part = _full_tile(kn_ptr + j.to(gl.int64) * skn, vn_ptr + j.to(gl.int64) * svn, ok,
                                    q_smem, kv_smem, p_smem, red_smem, o, m_i, l_part, qk_scale, D, NH)
    return o, m_i, gl.sum(l_part, axis=0)


# ------------------------------------------------------------------ the kernel
@gluon.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, lens_ptr, hist_ptr, wt_ptr, qt_ptr,
    kwin_ptr, vwin_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    po_ptr, pl_ptr, qk_scale, B, nsplit, nwin,
    sqn, sqh, skn, skh, svn, svh, stride_wt, stride_qt,
    H_KV: gl.constexpr, G_Q: gl.constexpr, NH: gl.constexpr, D: gl.constexpr, P: gl.constexpr,
    SINK: gl.constexpr, RECENT: gl.constexpr, HAS_HIST: gl.constexpr, STAGES: gl.constexpr,
    BITS: gl.constexpr,
):
    """One program: query token n, KV head kvh, split sid (< nsplit: history; else windows)."""
    WP: gl.constexpr = D * BITS // 8  # bytes per planar row
    X: gl.constexpr = 128 // D if BITS == 2 else 1  # value plane pairs per byte column (2: INT2 at D = 64)
    mma: gl.constexpr = _mma_layout(NH)
    n = gl.program_id(0)
    kvh = gl.program_id(1)
    sid = gl.program_id(2)
    i, start, L, n_hist = _token_state(cu_ptr, lens_ptr, hist_ptr, n, B, SINK, RECENT, HAS_HIST)
    t = n - start
    q_row = q_ptr + n.to(gl.int64) * sqn + kvh * G_Q * sqh
    ns = nsplit + nwin
    head = gl.arange(0, NH, layout=gl.SliceLayout(0, mma))
    prow = (n.to(gl.int64) * (H_KV * G_Q) + kvh * G_Q + head) * ns + sid  # [N] partial rows
    hok = head < G_Q
    m_rows = gl.arange(0, D, layout=gl.SliceLayout(1, mma))
    q_smem_h = gl.allocate_shared_memory(gl.float16, [NH, D], gl.NVMMASharedLayout.get_default_for([NH, D], gl.float16))
    p_smem_h = gl.allocate_shared_memory(gl.float16, [TILE, NH],
                                         gl.NVMMASharedLayout.get_default_for([TILE, NH], gl.float16))
    wdt: gl.constexpr = kwin_ptr.dtype.element_ty
    q_smem_w = gl.allocate_shared_memory(wdt, [NH, D], gl.NVMMASharedLayout.get_default_for([NH, D], wdt))
    kv_smem = gl.allocate_shared_memory(wdt, [TILE, D], gl.NVMMASharedLayout.get_default_for([TILE, D], wdt))
    p_smem_w = gl.allocate_shared_memory(wdt, [TILE, NH], gl.NVMMASharedLayout.get_default_for([TILE, NH], wdt))
    red_smem = gl.allocate_shared_memory(gl.float32, [4, NH], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    if sid < nsplit:
        chunk = ((n_hist + nsplit - 1) // nsplit + TILE - 1) // TILE * TILE
        lo = gl.minimum(sid * chunk, n_hist)
        hi = gl.minimum(lo + chunk, n_hist)
        o, m_i, l, zs = _history_part(q_row, sqh, qt_ptr + i.to(gl.int64) * stride_qt, kvh, lo, hi,
                                      kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, q_smem_h, p_smem_h,
                                      red_smem, qk_scale, H_KV, G_Q, NH, D, P, WP, X, STAGES, BITS)
        chan, offset = _value_channel(m_rows, WP, X, BITS)
        o = o * gl.expand_dims(_pow2(24 - offset), 1) - gl.expand_dims(zs, 0)
    else:
        o, m_i, l = _window_part(q_row, sqh, wt_ptr + i.to(gl.int64) * stride_wt, kvh, sid - nsplit, nwin,
                                 L, n_hist, t, kwin_ptr, vwin_ptr, k_ptr + (start.to(gl.int64) * skn + kvh * skh),
                                 v_ptr + (start.to(gl.int64) * svn + kvh * svh), skn, svn, q_smem_w, kv_smem,
                                 p_smem_w, red_smem, qk_scale, H_KV, G_Q, NH, D, P, SINK, RECENT)
        chan = m_rows
    _store_partial(po_ptr, pl_ptr, o, m_i, l, prow, chan, hok, m_rows, D)


# ------------------------------------------------------------------ host side
# The byte orders (formats.cache.code_layout) this kernel decodes: its fp16-operand fragments are
# built from planar rows, so INT2 at head_dim 128 (masked since cache format version 2) runs the
# Triton kernel until the 8-bit integer decode of issue #32 takes it.
CODE_LAYOUTS_READ = ("planar",)


def gluon_unsupported_reason(q, k, k_win, k_codes, k_scale, bits: int, group_size: int, N: int,
                             B: int) -> str | None:
    """Why the Gluon kernel does not take this call (None: it does). Shapes and dtypes only."""
    H_q, D = q.shape[1], q.shape[2]
    H_kv, P = k.shape[1], k_win.shape[2]
    if bits not in (2, 4):
        return f"bits {bits} (the Gluon kernel is INT2 / INT4)"
    if D not in (64, 128):
        return f"head_dim {D} (64 or 128)"
    if group_size != D:
        return f"group_size {group_size} below head_dim {D} (one scale group per token)"
    if P % 16:
        return f"page_size {P} is not a multiple of 16"
    layout = code_layout(bits, D, P)
    if layout not in CODE_LAYOUTS_READ:
        return (f"{layout} INT{bits} pages (cache format version {CACHE_FORMAT_VERSION}: this kernel reads "
                f"{'/'.join(CODE_LAYOUTS_READ)} code rows; the masked INT2 decode is issue #32's)")
    if H_q % H_kv or H_q // H_kv > 32:
        return f"{H_q} query heads over {H_kv} KV heads"
    return gluon_host.decode_call_problem(q, k_win, N, B)


# Registers per thread the decode launch is capped at: the cap sets how many 4-warp programs
# share an SM (4 at 128). Triton 3.6's ptxas fits the kernel in 128 without spills (23 spilled
# loads at 96, 70 at 80); H200 sweep in bench/results/2026-12-01-h200-gluon.
MAXNREG = 128
STAGES = 3  # shared-memory stages of the history pipeline (steps in flight during the math)
SMEM_PER_SM = 227 * 1024  # sm_90: shared memory a multiprocessor gives its blocks
SMEM_RESERVED_PER_BLOCK = 1024
MIN_SPLIT_TOKENS = 256  # shorter histories are not split (the Triton plan's 2 blocks of 128)
# History tiles one window tile costs: 7x the bytes (64 BF16 rows against INT2 codes + scales),
# and its two loads wait in turn. H200, run 10 (bench/results/2026-12-01-h200-gluon-pipeline):
# two window programs instead of one at 8k / 8 (16 history tiles per split) 31.3 against
# 36.0 µs, 32k / 1 (8) 17.1 against 19.1, 128k / 1 (31) 46.7 against 51.0; no change at 32k / 8
# (64) and 128k / 32 (128).
WINDOW_TILE_COST = 8


def programs_per_sm(maxnreg: int, head_dim: int, num_heads_n: int, window_bytes: int = 2,
                    stages: int = STAGES, scale_bytes: int = 2, bits: int = 2) -> int:
    """4-warp programs resident per SM under a register cap: the smaller of the register file
    (64K) and shared-memory limits. Shared memory: the query twice (history fp16, windows in
    their dtype), the two P tiles, the window tile, the warp-max exchange and the history stages
    (64 tokens of key and value codes, scales and zeros each; the kernel's static allocations)."""
    wp = head_dim * bits // 8
    stage = 64 * wp + (max(1, 128 // head_dim) if bits == 2 else 1) * 64 * wp + 4 * 64 * scale_bytes
    smem = (2 * num_heads_n * head_dim * 2 + 2 * 64 * num_heads_n * 2 + 64 * head_dim * window_bytes
            + 4 * num_heads_n * 4 + stages * stage + SMEM_RESERVED_PER_BLOCK + 256)
    return max(1, min(65536 // (maxnreg * 128), SMEM_PER_SM // smem, 32))


def plan_gluon_launch(N: int, B: int, H_kv: int, g: int, max_hist: int, sink: int, recent: int,
                      device, maxnreg: int = MAXNREG, head_dim: int = 128) -> tuple[int, int]:
    """(nsplit, nwin) from shapes only (CUDA-graph safe).

    The history programs of one split, N * H_kv, are sized to whole waves of the resident
    programs (``programs_per_sm``): a wave that spills over by a few programs runs them alone
    and costs as much as a full one (H200: 32k / batch 1, 64 splits on 396 slots took 28 µs,
    48 splits 24 µs). At least 2 tiles per split, whole tiles per split, and splits of at most
    MAX_SPLIT_TOKENS for precision, as in the Triton plan; nwin programs share the windows so
    that their chain of tiles is no longer than a history split's."""
    if max_hist <= MIN_SPLIT_TOKENS:
        # one split and one window program, whatever the table width: a CUDA-graph step (full-width
        # tables) and an eager one (tables trimmed to the batch) then launch the same programs,
        # and their outputs agree bitwise (tests/runtime/worker/test_cuda_graphs.py), as the Triton plan's
        # no-split rule below 2 x 128 tokens gives
        return 1, 1
    slots = programs_per_sm(maxnreg, head_dim, max(8, triton.next_power_of_2(g))) * num_sms(device)
    per_split = N * H_kv
    tiles = triton.cdiv(max_hist, TILE_TOKENS)
    # (the window programs, a few tiles each, fill the gaps the history programs leave: at
    # 8k / batch 32 leaving them a slot cost a whole split, 194 µs against 134 for the Triton kernel)
    fit = max(1, slots // per_split)
    if tiles == 0:
        nsplit = 1
    else:
        nsplit = min(fit, max(1, tiles // 2))
        precision = triton.cdiv(max_hist, MAX_SPLIT_TOKENS)
        if precision > nsplit:  # several waves anyway: whole ones
            nsplit = triton.cdiv(precision, fit) * fit
        nsplit = triton.cdiv(tiles, triton.cdiv(tiles, nsplit))
    split_tiles = triton.cdiv(tiles, nsplit) if tiles else 0
    # a window tile costs about WINDOW_TILE_COST pipelined history tiles (16-bit rows, and its
    # loads are not pipelined), so the window chain is measured in history tiles
    nwin = plan_window_splits(triton.cdiv(sink + recent, TILE_TOKENS) + 1,
                              max(1, split_tiles // WINDOW_TILE_COST))
    return nsplit, nwin


def attention_gluon(q, k, v, cu_seqlens, cache_lens, window_table, quant_table, k_win, v_win,
                    k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, scale, sink, recent, bits,
                    group_size, history_lens=None, nsplit: int | None = None,
                    win_splits: int | None = None, stages: int = STAGES, maxnreg: int = MAXNREG):
    """Check, plan and launch; the contract of ``oscar::attention`` (docs/cache-format.md).

    q: [N, H_q, D], k, v: [N, H_kv, D] -> [N, H_q, D] in q.dtype. ``nsplit`` / ``win_splits``
    override the plan, ``stages`` sets the shared-memory stages of the history pipeline,
    ``maxnreg`` caps the registers per thread (benchmark sweeps, tests)."""
    import torch

    s, out = gluon_host.begin_decode("Gluon decode kernel", lambda N, B: gluon_unsupported_reason(
        q, k, k_win, k_codes, k_scale, bits, group_size, N, B), q, k, v, cache_lens, k_win,
        (k_win, v_win, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero), history_lens)
    if s.N == 0:
        return out
    nsplit, nwin = gluon_host.fill_plan(nsplit, win_splits, lambda: plan_gluon_launch(
        s.N, s.B, s.H_kv, s.g, quant_table.shape[1] * s.P, sink, recent, q.device, maxnreg, s.D))
    ns = nsplit + nwin
    po, pl = gluon_host.split_partials(s, ns, q.device)
    _decode_kernel[(s.N, s.H_kv, ns)](
        *gluon_host.decode_launch_args(
            q, k, v, cu_seqlens, cache_lens, history_lens, window_table, quant_table, k_win, v_win,
            (k_codes.view(torch.int32), k_scale, k_zero, v_codes, v_scale, v_zero), po, pl, scale * LOG2E,
            nsplit, nwin),
        H_KV=s.H_kv, G_Q=s.g, NH=max(8, triton.next_power_of_2(s.g)), D=s.D, P=s.P, SINK=sink, RECENT=recent,
        HAS_HIST=history_lens is not None, STAGES=stages, BITS=bits, num_warps=4,
        maxnreg=maxnreg,
    )
    merge_partials(po, pl, out, ns)
    return out


def compile_offline(head_dim: int = 128, num_q_per_kv: int = 4, num_kv_heads: int = 8,
                    page_size: int = 16, sink: int = 64, recent: int = 256,
                    window_dtype: str = "bf16", scale_dtype: str = "fp16", has_hist: bool = False,
                    stages: int = STAGES, maxnreg: int = MAXNREG, bits: int = 2):
    """Compile the kernel for sm_90 without a GPU (``gluon_host.compile_decode_offline``)."""
    g = num_q_per_kv
    consts = {"H_KV": num_kv_heads, "G_Q": g, "NH": max(8, triton.next_power_of_2(g)), "D": head_dim,
              "P": page_size, "SINK": sink, "RECENT": recent, "HAS_HIST": has_hist, "STAGES": stages, "BITS": bits}
    pools = ("i32", scale_dtype, scale_dtype, "u8", scale_dtype, scale_dtype)
    return gluon_host.compile_decode_offline(_decode_kernel, window_dtype, pools, consts, maxnreg)
