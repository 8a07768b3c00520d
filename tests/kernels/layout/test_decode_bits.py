"""The INT-b decode's PTX, emulated instruction by instruction, against the plain Triton decode.

The inline PTX runs only on a GPU; this reads the same strings (``mov``, ``prmt``, ``and``,
``xor`` on 32-bit registers, the only instructions they use) and executes them on every byte value, so a
wrong selector or mask fails here on the CPU. The reference is decode_plane's non-PTX branch
spelled in numpy: the plane's bits kept in place and read as an fp16 (a subnormal, exactly
c * 2^(b * plane - 24)).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from oscar_compile.kernels.layout import code_decode_triton as decode


def _prmt(a: int, b: int, sel: int) -> int:
    pool = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(pool[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def run_ptx(asm: str, word: int) -> tuple[int, int]:
    """Execute the decode PTX on one 32-bit input; returns ($0, $1)."""
    regs = {"$2": word}

    def val(x: str) -> int:
        x = x.strip()
        return regs[x] if x in regs else int(x, 0)

    for ins in re.findall(r"^(mov|prmt|and|xor)\.b32 ([^;]*);", asm, re.M):
        op, args = ins[0], [a.strip() for a in ins[1].split(",")]
        if op == "mov":
            regs[args[0]] = val(args[1])
        elif op == "prmt":
            regs[args[0]] = _prmt(val(args[1]), val(args[2]), val(args[3]))
        elif op == "and":
            regs[args[0]] = val(args[1]) & val(args[2])
        else:
            regs[args[0]] = val(args[1]) ^ val(args[2])
    return regs["$0"], regs["$1"]


@pytest.mark.parametrize("bits,plane,asm,flip", [
    (2, 0, decode.ASM2_0, 0), (2, 1, decode.ASM2_1, 0), (2, 2, decode.ASM2_2, 0), (2, 3, decode.ASM2_3, 0),
    (2, 3, decode.ASM2_3_FLIP, 2), (4, 0, decode.ASM4_0, 0), (4, 1, decode.ASM4_1, 0),
])
def test_decode_ptx_matches_the_plain_decode(bits, plane, asm, flip):
    """``flip``: the top bit pair of a masked INT2 byte holds (c + 2) mod 4 = c ^ 2."""
    asm = asm.value if hasattr(asm, "value") else asm
    rng = np.random.default_rng(plane)
    words = list(range(256)) + [int(w) for w in rng.integers(0, 2 ** 32, 2000, dtype=np.uint64)]
    for word in words:  # the first 256 put every byte value in byte 0, the rest mix all four
        lo, hi = run_ptx(asm, word)
        got = np.array([lo, hi], dtype=np.uint32).view(np.float16)  # 4 halves = 4 elements
        b = np.frombuffer(word.to_bytes(4, "little"), dtype=np.uint8)
        kept = ((b & (((1 << bits) - 1) << (bits * plane))) ^ (flip << (bits * plane))).astype(np.uint16)
        want = kept.view(np.float16)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), hex(word)
        codes = ((b >> (bits * plane)) & ((1 << bits) - 1)) ^ flip
        assert np.array_equal(got.astype(np.float64), codes * 2.0 ** (bits * plane - 24))
