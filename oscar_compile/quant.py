"""The reference quantizer: the numerical oracle every kernel and cache is tested against.

Plain torch, float32 math. The rules (docs/design.md §4, docs/cache-format.md) in the order applied to
one vector x of D channels, already in rotated coordinates:

1. per-token clip: tau = quantile(|x|, rho) over the D channels, linear interpolation between
   order statistics (what ``torch.quantile`` does); x <- clamp(x, -tau, tau). rho = 1: no clip.
2. per group of G consecutive channels, asymmetric min-max:
   s = max((max - min) / (2^b - 1), max(|min|, |max|) / 2^10), with s = 1 when that is 0 (an
   all-zero group); z = -min / s. The floor keeps |z| <= 2^10, so a nearly constant group far
   from 0 cannot overflow an fp16 zero (it costs nothing: such a group's spread is below what its
   16-bit values resolve). s and z are rounded to ``scale_dtype`` *before* the codes are
   computed, so codes and the stored scale/zero agree:
   code = clamp(round_half_to_even(x / s + z), 0, 2^b - 1); dequant = s * (code - z).
3. planar packing: n = 8 / b codes per byte; byte j of a row holds channels j, j + D/n, ...,
   at bit offsets 0, b, 2b, ... A kernel unpacks a contiguous block of D/n channels from the
   whole byte row with one shift and one mask. (The cache's pools store INT2 at head_dim 128 in
   another byte order, per 16-token block: ``formats.cache.code_layout``,
   ``kernels/layout/code_layout_ref.py``.)
"""
from __future__ import annotations

import torch

from .formats.cache import SCALE_DTYPE_BYTES

SUPPORTED_BITS = (2, 4)
ZERO_POINT_FLOOR = 2.0**-10  # scale >= this times the group's largest magnitude: |zero| <= 2^10
_SCALE_DTYPES = {name: getattr(torch, name) for name in SCALE_DTYPE_BYTES}  # the names of formats.cache


def scale_dtype_of(name: str | torch.dtype) -> torch.dtype:
    """Map a spec's ``scale_dtype`` name to the torch dtype (torch dtypes pass through)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _SCALE_DTYPES[name]
    except KeyError:
        raise ValueError(f"scale_dtype must be one of {sorted(_SCALE_DTYPES)}, got {name!r}") from None


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def clip_threshold(x: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """tau_t = rho-quantile of |x_t| over the last dim, linear interpolation. x: [..., D] -> [..., 1].

    Written with a sort rather than ``torch.quantile`` (which caps the input size), giving the
    same numbers: position rho * (D - 1) between the sorted order statistics.
    """
    D = x.shape[-1]
    sorted_abs = x.abs().float().sort(dim=-1).values
    pos = clip_ratio * (D - 1)
    lo = int(pos)
    hi = min(lo + 1, D - 1)
    frac = pos - lo
    lo_v, hi_v = sorted_abs[..., lo : lo + 1], sorted_abs[..., hi : hi + 1]
    return lo_v + frac * (hi_v - lo_v)


def clip_per_token(x: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """Clamp each row of x: [..., D] to [-tau, tau] with tau its ``clip_ratio``-quantile of |x|."""
    if not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    x = x.float()
    if clip_ratio == 1.0:
        return x
    tau = clip_threshold(x, clip_ratio)
    return torch.minimum(torch.maximum(x, -tau), tau)


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    D = x.shape[-1]
    if D % group_size:
        raise ValueError(f"group_size {group_size} does not divide the last dim {D}")
    return x.reshape(*x.shape[:-1], D // group_size, group_size)


def quantize_groups(
    x: torch.Tensor, bits: int, group_size: int, scale_dtype: str | torch.dtype = "float16"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization per group of ``group_size`` channels along the last dim.

    x: [..., D] (any float dtype; math in float32). Returns codes [..., D] uint8 (unpacked),
    scale and zero [..., D // group_size] in ``scale_dtype``.
    """
    _check_bits(bits)
    sdt = scale_dtype_of(scale_dtype)
    qmax = 2**bits - 1
    xg = _grouped(x.float(), group_size)  # [..., D/G, G]
    lo = xg.amin(dim=-1)
    hi = xg.amax(dim=-1)
    # a tensor divisor: on CUDA, division by a Python scalar is a multiply by its rounded reciprocal
    s = (hi - lo) / torch.full_like(hi, qmax)
    s = torch.maximum(s, torch.maximum(lo.abs(), hi.abs()) * ZERO_POINT_FLOOR)
    s = torch.where(s == 0, torch.ones_like(s), s)
    z = -lo / s
    scale, zero = s.to(sdt), z.to(sdt)
    s32, z32 = scale.float().unsqueeze(-1), zero.float().unsqueeze(-1)
    codes = torch.clamp(torch.round(xg / s32 + z32), 0, qmax).to(torch.uint8)
    return codes.reshape(x.shape), scale, zero


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """s * (code - z) per group. codes: [..., D] uint8; scale, zero: [..., D/G]. -> float32 [..., D]."""
    cg = _grouped(codes.float(), group_size)
    out = scale.float().unsqueeze(-1) * (cg - zero.float().unsqueeze(-1))
    return out.reshape(codes.shape)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Planar packing of unpacked codes [..., D] uint8 into [..., D * bits / 8] uint8."""
    _check_bits(bits)
    n = 8 // bits
    D = codes.shape[-1]
    if D % n:
        raise ValueError(f"last dim {D} is not a multiple of {n} codes per byte")
    planes = codes.to(torch.uint8).reshape(*codes.shape[:-1], n, D // n)  # plane i: channels i*D/n ..
    packed = torch.zeros(planes.shape[:-2] + (D // n,), dtype=torch.uint8, device=codes.device)
    for i in range(n):
        packed |= planes[..., i, :] << (bits * i)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: [..., D * bits / 8] uint8 -> [..., D] uint8."""
    _check_bits(bits)
    n = 8 // bits
    mask = 2**bits - 1
    planes = [(packed >> (bits * i)) & mask for i in range(n)]
    return torch.cat(planes, dim=-1)


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    clip_ratio: float = 1.0,
    scale_dtype: str | torch.dtype = "float16",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clip, quantize and pack: x [..., D] -> (packed [..., D*bits/8] uint8, scale, zero [..., D/G])."""
    codes, scale, zero = quantize_groups(clip_per_token(x, clip_ratio), bits, group_size, scale_dtype)
    return pack_codes(codes, bits), scale, zero


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """Unpack and dequantize: -> float32 [..., D]."""
    return dequantize_groups(unpack_codes(packed, bits), scale, zero, group_size)


def fake_quantize(
    x: torch.Tensor,
    bits: int = 2,
    group_size: int = 128,
    clip_ratio: float = 1.0,
    scale_dtype: str | torch.dtype = "float16",
) -> torch.Tensor:
    """Quantize then dequantize x [..., D] (groups along the last dim); same shape and dtype as x.

    bits = 16 returns x unchanged (the spec's "no quantization").
    """
    if bits == 16:
        return x
    codes, scale, zero = quantize_groups(clip_per_token(x, clip_ratio), bits, group_size, scale_dtype)
    return dequantize_groups(codes, scale, zero, group_size).to(x.dtype)


def bits_per_element(
    head_dim: int,
    bits: int,
    group_size: int,
    scale_dtype: str | torch.dtype = "float16",
    context: int | None = None,
    sink_tokens: int = 0,
    recent_tokens: int = 0,
    window_bits: int = 16,
) -> float:
    """Average stored bits per cached K/V element, counting everything honestly.

    Payload + scale and zero per group for quantized tokens; ``window_bits`` (BF16 = 16) for the
    sink and recent windows at the given ``context`` length. ``context=None`` gives the
    asymptotic figure (windows negligible). bits = 16 returns 16.
    """
    if bits == 16:
        return 16.0
    _check_bits(bits)
    sdt_bits = torch.finfo(scale_dtype_of(scale_dtype)).bits
    quant_bits = bits + 2 * sdt_bits / group_size
    if context is None:
        return quant_bits
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    num_window = min(context, sink_tokens + recent_tokens)
    num_quant = context - num_window
    return (num_quant * quant_bits + num_window * window_bits) / context
