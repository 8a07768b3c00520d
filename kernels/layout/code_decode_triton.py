"""INT-b code bytes to float16 in registers, for the Triton attention kernel's tensor-core dots.

A code's bits, kept in place by one AND and read as an fp16, are the subnormal
c * 2^(b * plane + CODE_EXP): exact, no conversion, no offset to subtract. The factor 2^(b * plane)
(a power of two: plane_factor) is folded into the query (keys) and into the accumulators (values)
by the caller. On the GPU the AND runs as inline PTX over 4 bytes at a time (_dequant_asm); the
plain Triton branch is the same bits, and the reference of tests/kernels/layout/test_decode_bits.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

CODE_EXP = tl.constexpr(-24)  # a decoded code c of plane p is the fp16 number c * 2^(b*p - 24)


def _dequant_asm(mask: int, flip: int = 0) -> str:
    """PTX for 4 packed bytes -> the codes of one plane as 4 fp16 (two f16x2 registers).

    Two byte permutes spread the bytes over the four 16-bit halves (byte i -> half i, high bytes
    zero); one AND per register keeps the plane's bits in place. The 16-bit pattern (c << b*p) is
    the fp16 subnormal c * 2^(b*p - 24): exact, no conversion, no offset to subtract. Output i
    depends on input byte i only, so the result does not depend on how Triton lays out the tensor.
    The plane factor 2^(b*p) is folded into q (keys) and into the accumulators (values); ptxas
    shares the two permutes between the planes of one byte vector. 1 instruction per element.
    ``flip``: XORed after the AND (ptxas makes the pair one LOP3): the top bit pair of a masked
    INT2 byte stores (c + 2) mod 4, which is c ^ 2.
    """
    tail = f"xor.b32 $0, $0, {flip:#010x};\nxor.b32 $1, $1, {flip:#010x};\n" if flip else ""
    return (
        "{\n.reg .b32 lo, hi, z;\nmov.b32 z, 0;\n"
        "prmt.b32 lo, $2, z, 0x4140;\nprmt.b32 hi, $2, z, 0x4342;\n"
        f"and.b32 $0, lo, {mask:#010x};\nand.b32 $1, hi, {mask:#010x};\n{tail}}}"
    )


ASM2_0 = tl.constexpr(_dequant_asm(0x00030003))
ASM2_1 = tl.constexpr(_dequant_asm(0x000C000C))
ASM2_2 = tl.constexpr(_dequant_asm(0x00300030))
ASM2_3 = tl.constexpr(_dequant_asm(0x00C000C0))
ASM2_3_FLIP = tl.constexpr(_dequant_asm(0x00C000C0, 0x00800080))
ASM4_0 = tl.constexpr(_dequant_asm(0x000F000F))
ASM4_1 = tl.constexpr(_dequant_asm(0x00F000F0))


@triton.jit
def _asm_codes(b, asm: tl.constexpr):
    return tl.inline_asm_elementwise(asm, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def decode_plane(b, PLANE: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, FLIP: tl.constexpr = False):
    """Codes of plane PLANE from packed bytes b: [..., WP] uint8 -> float16 holding
    c * 2^(BITS * PLANE + CODE_EXP), exactly (a subnormal: the code's bits read as an fp16).
    FLIP (INT2 plane 3 of a masked page): the bits hold (c + 2) mod 4, decoded as c ^ 2."""
    if USE_ASM:
        if BITS == 2:
            if PLANE == 0:
                out = _asm_codes(b, ASM2_0)
            elif PLANE == 1:
                out = _asm_codes(b, ASM2_1)
            elif PLANE == 2:
                out = _asm_codes(b, ASM2_2)
            elif FLIP:
                out = _asm_codes(b, ASM2_3_FLIP)
            else:
                out = _asm_codes(b, ASM2_3)
        else:
            if PLANE == 0:
                out = _asm_codes(b, ASM4_0)
            else:
                out = _asm_codes(b, ASM4_1)
    else:
        bits = b & (((1 << BITS) - 1) << (PLANE * BITS))
        if FLIP:
            bits = bits ^ 0x80
        out = bits.to(tl.uint16).to(tl.float16, bitcast=True)
    return out


@triton.jit
def plane_factor(E):
    """2^E as float32 for an integer -126 <= E <= 127, built from its bits (exact)."""
    return tl.full([], (E + 127) << 23, tl.int32).to(tl.float32, bitcast=True)
