"""Triton ``oscar::rms_norm``, ``oscar::rope`` and ``oscar::silu_mul``: one launch each.

They replace chains of small PyTorch kernels whose launch costs dominate a batch-1 decode step
(see elementwise_ref.py). Each rounds where the Hugging Face formula rounds (products to the
input dtype before they are added), so outputs match the reference to float32 summation order:
bitwise for RoPE and SiLU-mul without rotation, within an ulp of the output dtype elsewhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_compile.kernels.determinism import is_deterministic
from oscar_compile.kernels.device import interpreting, num_sms
from oscar_compile.kernels.elementwise.rotate_ref import check_rotate_args


@triton.jit(do_not_specialize=["n_rows", "inner"])
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, inner, stride_outer, stride_inner, eps,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Rows of ``x`` seen as [outer, inner] with two strides (a head view of a merged projection
    is not one uniform stride: [B * T, H] rows)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    h = (x * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF rounds to the input dtype here
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :],
             (w[None, :] * h).to(out_ptr.dtype.element_ty), mask=mask)


def _as_two_strides(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [outer, inner, D] with a unit last stride, copying only when no such view exists."""
    D = x.shape[-1]
    inner = x.shape[-2] if x.dim() > 1 else 1
    try:
        x3 = x.view(-1, inner, D)
    except RuntimeError:
        x3 = x.reshape(-1, inner, D)
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out
    x3 = _as_two_strides(x)
    n, inner = x3.shape[0] * x3.shape[1], x3.shape[1]
    block_d = triton.next_power_of_2(D)
    rows = max(1, min(16, 2048 // block_d))
    _rms_norm_kernel[(triton.cdiv(n, rows),)](
        x3, weight, out, n, inner, x3.stride(0), x3.stride(1), float(eps), D=D, BLOCK_D=block_d, ROWS=rows,
        num_warps=8 if block_d >= 4096 else 4)
    return out


@triton.jit(do_not_specialize=["T", "NT"])
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, rot_ptr, mean_ptr, qo_ptr, ko_ptr, T, NT, rot_group,
                 sqb, sqh, sqt, skb, skh, skt, scb, sct, ssb, sst,
                 H_KV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, TOKS: tl.constexpr,
                 BK: tl.constexpr, BN: tl.constexpr, HAS_ROT: tl.constexpr, HAS_MEAN: tl.constexpr,
                 PRECISION: tl.constexpr, SPLIT_DT: tl.constexpr):
    """TOKS tokens x one KV head: row r is head r % (G + 1) of token r // (G + 1), heads 0..G-1
    its query heads, head G its key head (rows past TOKS * (G + 1) idle). With the rotation,
    program_id(2) picks BN of the D output columns (each program redoes the RoPE). PRECISION is
    the rotation's, "ieee" or "bf16x3" (rope_precision; Triton's tf32x3 was slower than ieee on
    an H100: bench/results/2026-12-07-gpu-int2-prefill-step, call a); SPLIT_DT the dtype bf16x3's
    parts enter the dot in: bfloat16, float32 in the interpreter (whose dot would multiply
    bfloat16's raw bit patterns)."""
    r = tl.arange(0, ROWS)
    hh = r % (G + 1)
    # offsets of a large batch pass 2^31 (64 x 8k tokens x 32 heads x 128)
    n = tl.program_id(0).to(tl.int64) * TOKS + r // (G + 1)
    ok = (r < TOKS * (G + 1)) & (n < NT)
    n = tl.where(ok, n, 0)
    j = tl.program_id(1)
    b = n // T
    t = n % T
    is_q = ok & (hh < G)
    is_k = ok & (hh == G)
    dt = qo_ptr.dtype.element_ty
    q_rows = q_ptr + b * sqb + (j * G + hh) * sqh + t * sqt
    k_rows = k_ptr + b * skb + j * skh + t * skt
    qo_rows = qo_ptr + ((n * H_KV + j) * G + hh) * D
    ko_rows = ko_ptr + (n * H_KV + j) * D
    cos_rows = cos_ptr + b * scb + t * sct
    sin_rows = sin_ptr + b * ssb + t * sst
    b0 = tl.program_id(0).to(tl.int64) // T
    t0 = tl.program_id(0).to(tl.int64) % T
    HALF: tl.constexpr = D // 2
    acc = tl.zeros([ROWS, BN], dtype=tl.float32)
    mean_rot = tl.zeros([BN], dtype=tl.float32)  # bf16x3: mean @ R, taken off the key rows at the end
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    for k0 in tl.static_range(0, D, BK):
        c = k0 + tl.arange(0, BK)
        partner = (c + HALF) % D  # rotate_half: [-x2, x1]
        sign = tl.where(c < HALF, -1.0, 1.0)
        x = tl.where(is_q[:, None], tl.load(q_rows[:, None] + c[None, :], mask=is_q[:, None], other=0.0),
                     tl.load(k_rows[:, None] + c[None, :], mask=is_k[:, None], other=0.0)).to(tl.float32)
        xp = tl.where(is_q[:, None], tl.load(q_rows[:, None] + partner[None, :], mask=is_q[:, None], other=0.0),
                      tl.load(k_rows[:, None] + partner[None, :], mask=is_k[:, None], other=0.0)).to(tl.float32)
        if TOKS == 1:  # one position: one row of cos / sin, as before the packing (H200, batch 1:
            # 5.0 µs that way, 5.4 loading a row per token; this branch itself not re-timed)
            cos = tl.load(cos_ptr + b0 * scb + t0 * sct + c).to(tl.float32)[None, :]
            sin = tl.load(sin_ptr + b0 * ssb + t0 * sst + c).to(tl.float32)[None, :]
        else:
            cos = tl.load(cos_rows[:, None] + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            sin = tl.load(sin_rows[:, None] + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        y = ((x * cos).to(dt).to(tl.float32) + (sign[None, :] * xp * sin).to(dt).to(tl.float32))
        y = y.to(dt).to(tl.float32)
        if HAS_ROT:
            R = tl.load(rot_ptr + (j // rot_group) * D * D + c[:, None] * D + cols[None, :])
            if HAS_MEAN:
                mu = tl.load(mean_ptr + (j // rot_group) * D + c)
            if PRECISION == "bf16x3":
                # y holds bfloat16 values (the output dtype), an exact bf16 operand; R is cut into
                # three bf16 parts that sum to it exactly (8 + 8 + 8 bits of its 24), so each
                # product is exact and only the float32 sums round, as in the ieee path. The
                # centred key rows are not bf16 values: (y - mean) R = y R - mean R, the latter
                # in float32 here.
                a = y.to(tl.bfloat16).to(SPLIT_DT)
                r1 = R.to(tl.bfloat16)
                rest = R - r1.to(tl.float32)
                r2 = rest.to(tl.bfloat16)
                r3 = (rest - r2.to(tl.float32)).to(tl.bfloat16).to(SPLIT_DT)
                r1, r2 = r1.to(SPLIT_DT), r2.to(SPLIT_DT)
                acc = tl.dot(a, r3, acc)
                acc = tl.dot(a, r2, acc)
                acc = tl.dot(a, r1, acc)
                if HAS_MEAN:
                    mean_rot += tl.sum(mu[:, None] * R, axis=0)
            else:
                if HAS_MEAN:
                    y = y - tl.where(is_k[:, None], mu[None, :], 0.0)
                acc += tl.dot(y, R, input_precision="ieee")
        else:
            tl.store(qo_rows[:, None] + c[None, :], y.to(dt), mask=is_q[:, None])
            tl.store(ko_rows[:, None] + c[None, :], y.to(dt), mask=is_k[:, None])
    if HAS_ROT:
        if PRECISION == "bf16x3" and HAS_MEAN:
            acc = acc - tl.where(is_k[:, None], mean_rot[None, :], 0.0)
        tl.store(qo_rows[:, None] + cols[None, :], acc.to(dt), mask=is_q[:, None])
        tl.store(ko_rows[:, None] + cols[None, :], acc.to(dt), mask=is_k[:, None])


def rope_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Inputs the kernel handles (others take the reference): D a power of two >= 32, H_q = g * H_kv,
    one dtype for all four (HF would promote a bf16 q times float32 cos), unit last strides."""
    D = q.shape[-1]
    return (D >= 32 and D & (D - 1) == 0 and q.shape[1] % k.shape[1] == 0 and q.shape[1] // k.shape[1] < 64
            and len({q.dtype, k.dtype, cos.dtype, sin.dtype}) == 1
            and all(t.stride(-1) == 1 for t in (q, k, cos, sin)))


def rope_column_blocks(programs: int, D: int, device: torch.device) -> int:
    """Programs per (tokens, KV head) program for the rotation: its [16, D] x [D, D] float32
    product ran on 8 programs at batch 1 (Qwen3-8B), a chain of D * D / 16 FMAs per thread. Split
    the output columns (into blocks of no fewer than 16) until about two programs per SM run."""
    sms = num_sms(device)
    blocks = 1
    while blocks * 2 <= D // 16 and programs * blocks * 2 <= 2 * sms:
        blocks *= 2
    return blocks


# the rotation of a prefill-sized bf16 call on the tensor cores ("bf16x3": _rope_kernel) from this
# many tokens on, in programs of MMA_ROWS rows; below it (decode steps), for other dtypes and in
# deterministic mode, float32 products on the CUDA cores ("ieee") in 16-row programs
MMA_MIN_TOKENS = 64
MMA_ROWS = 64
PRECISIONS = ("ieee", "bf16x3")


def rope_precision(num_tokens: int, dtype: torch.dtype) -> str:
    """The rotation's precision. ``bf16x3`` sums the same exact products as ``ieee`` in another
    order (float32 rounding before the output's own rounding: at most an ulp of it). Deterministic
    mode keeps ``ieee``: one K order for every token count, whatever the MMA shape."""
    if is_deterministic() or dtype != torch.bfloat16 or num_tokens < MMA_MIN_TOKENS:
        return "ieee"
    return "bf16x3"


def rope_triton(q, k, cos, sin, rot=None, mean=None, col_blocks: int | None = None,
                rows_per_program: int | None = None, precision: str | None = None, num_warps: int = 4):
    """See elementwise_ref.rope_ref; outputs stored [B, T, H, D], returned as [B, H, T, D] views.
    ``col_blocks`` overrides the rotation's column split (rope_column_blocks); ``rows_per_program``,
    ``precision`` (rope_precision) and ``num_warps`` the rotation's tiling: benchmark knobs."""
    if precision not in (None, *PRECISIONS):
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16x3" and q.dtype != torch.bfloat16:
        raise ValueError(f"bf16x3 takes bfloat16 inputs (exact bf16 operands), got {q.dtype}")
    B, H_q, T, D = q.shape
    H_kv = k.shape[1]
    G = H_q // H_kv
    if rot is not None:
        check_rotate_args(k, rot, mean)
    if cos.shape not in ((B, T, D), (1, T, D)) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must be [{B} or 1, {T}, {D}], got {tuple(cos.shape)} / {tuple(sin.shape)}")
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)  # positions shared by the batch: stride 0
    q_out = torch.empty(B, T, H_q, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(B, T, H_kv, D, dtype=k.dtype, device=k.device)
    if B * T:
        NT = B * T
        rows, toks, ncol = triton.next_power_of_2(G + 1), 1, 1
        precision = precision or ("ieee" if rot is None else rope_precision(NT, q.dtype))
        if rot is not None:
            # ieee: a 16-row dot, of which one token fills G + 1 rows (Qwen3-8B: 5): pack as
            # many tokens as fit (3), a third of the multiply-adds per token (sm_90 SASS, Triton
            # 3.6; 64 rows gained no more and spilled); on the tensor cores, 64 rows (12 tokens)
            rows = rows_per_program or max(MMA_ROWS if precision != "ieee" else 16, rows)
            if rows < G + 1 or rows & (rows - 1):
                raise ValueError(f"rows_per_program must be a power of two >= {G + 1}, got {rows}")
            # (one token: the TOKS == 1 path; else a fixed count, the tail masked, so that a
            # server's steps of 2, 3, ... tokens do not each compile a variant)
            toks = 1 if NT == 1 and not is_deterministic() else max(1, rows // (G + 1))
            if is_deterministic():  # one tiling of the rotation's K for every token count
                ncol = col_blocks or max(1, D // 32)
            else:
                ncol = col_blocks or rope_column_blocks(triton.cdiv(NT, toks) * H_kv, D, q.device)
            if D % ncol or ncol & (ncol - 1):
                raise ValueError(f"col_blocks must be a power of two dividing {D}, got {ncol}")
        rot_arg = rot.float().contiguous() if rot is not None else q
        mean_arg = mean.float().contiguous() if mean is not None else q
        rot_group = H_kv // rot.shape[0] if rot is not None else 1
        # R in [bk, bn] tiles of at most 4096: all of K at once for narrow column blocks (H200,
        # batch 1: 5.0 µs, 6.1 in 32-row tiles); 32 rows for D = 128 columns (one [128, 128] tile
        # spilled: 110 µs at batch 64, 14 in 32-row tiles)
        bn = D // ncol
        bk = max(16, min(D, 4096 // bn))
        _rope_kernel[(triton.cdiv(NT, toks), H_kv, ncol)](
            q, k, cos, sin, rot_arg, mean_arg, q_out, k_out, T, NT, rot_group,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            H_KV=H_kv, G=G, D=D, ROWS=rows, TOKS=toks, BK=bk, BN=bn, HAS_ROT=rot is not None,
            HAS_MEAN=mean is not None, PRECISION=precision, SPLIT_DT=tl.float32 if interpreting() else tl.bfloat16,
            num_warps=num_warps, enable_fp_fusion=False)  # float32: torch's separate multiply and add, no FMA
    return q_out.transpose(1, 2), k_out.transpose(1, 2)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, width, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu rounds to the dtype before the product
    tl.store(out_ptr + row * width + cols, (s * u).to(dt), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[rows, width] with a unit last stride; the two halves of a merged gate/up GEMM are views."""
    try:
        x2 = x.view(-1, x.shape[-1])
    except RuntimeError:
        x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} / {tuple(up.shape)} {up.dtype}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        g2, u2 = _rows(gate), _rows(up)
        width = g2.shape[1]
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(width, 1024))](
            g2, u2, out, width, g2.stride(0), u2.stride(0), BLOCK=1024, num_warps=4)
    return out
