"""The masked INT2 page layout (kernels/code_layout_ref.py) against the quantizer and the issue's formula."""

from __future__ import annotations

import pytest
import torch

from oscar_compile import quant
from oscar_compile.formats.cache import CACHE_FORMAT_VERSION, check_cache_format_version, code_layout
from oscar_compile.kernels import code_layout_ref as cl


def _codes(*shape, seed=0):
    return torch.randint(0, 4, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _formula_key_block(codes):
    """Issue #32's key byte order, one code at a time: byte 128q+32t+8s+4hh+b, pair j = token 4q+j,
    channel 32s+16hh+4t+b, pair 3 stored as (c+2) mod 4."""
    out = [0] * 512
    for q in range(4):
        for t in range(4):
            for s in range(4):
                for hh in range(2):
                    for b in range(4):
                        byte = 0
                        for j in range(4):
                            c = int(codes[4 * q + j, 32 * s + 16 * hh + 4 * t + b])
                            byte |= ((c + 2) % 4 if j == 3 else c) << (2 * j)
                        out[128 * q + 32 * t + 8 * s + 4 * hh + b] = byte
    return torch.tensor(out, dtype=torch.uint8)


def _formula_value_block(codes):
    """Values: byte 16(8w+g)+4s+b, pair j = token 4s+b, channel 16w+g+8(j&1)+64(j>>1)."""
    out = [0] * 512
    for w in range(4):
        for g in range(8):
            for s in range(4):
                for b in range(4):
                    byte = 0
                    for j in range(4):
                        c = int(codes[4 * s + b, 16 * w + g + 8 * (j & 1) + 64 * (j >> 1)])
                        byte |= ((c + 2) % 4 if j == 3 else c) << (2 * j)
                    out[16 * (8 * w + g) + 4 * s + b] = byte
    return torch.tensor(out, dtype=torch.uint8)


def test_layout_choice():
    assert code_layout(2, 128, 16) == "masked"
    assert code_layout(2, 128, 32) == "masked"
    assert code_layout(2, 128, 8) == "planar"
    assert code_layout(2, 64, 16) == "planar"
    assert code_layout(4, 128, 16) == "planar"
    assert code_layout(16, 128, 16) == "rows"


def test_pack_matches_the_formula():
    codes = _codes(16, 128)
    assert torch.equal(cl.pack_key_page(codes).flatten(), _formula_key_block(codes))
    assert torch.equal(cl.pack_value_page(codes).flatten(), _formula_value_block(codes))


@pytest.mark.parametrize("kind", ["k", "v"])
def test_round_trip_of_the_quantizer(kind):
    x = torch.randn(3, 2, 32, 128, generator=torch.Generator().manual_seed(1))  # [pages, H, P, D]
    codes, _, _ = quant.quantize_groups(x, 2, 128)
    packed = cl.pack_page(codes, kind, 2)
    assert packed.shape == (3, 2, 32, 32)
    assert torch.equal(cl.unpack_page(packed, kind, 2), codes)
    assert torch.equal(cl.unpack_page(cl.pack_page(codes, kind, 4), kind, 4), codes)  # INT4: planar
    x64 = x[..., :64]
    c64, _, _ = quant.quantize_groups(x64, 2, 64)
    assert torch.equal(cl.pack_page(c64, kind, 2), quant.pack_codes(c64, 2))  # head_dim 64: planar


def test_byte_ownership():
    """A value byte belongs to one token; a key byte to the 4 tokens of one quad of one page."""
    codes = _codes(16, 128, seed=2)
    kb, vb = cl.pack_key_page(codes).flatten(), cl.pack_value_page(codes).flatten()
    for tok in (0, 6, 15):
        c2 = codes.clone()
        c2[tok] = (c2[tok] + 1) % 4
        kd = (cl.pack_key_page(c2).flatten() != kb).nonzero().flatten()
        assert len(kd) == 128 and kd.min() >= 128 * (tok // 4) and kd.max() < 128 * (tok // 4 + 1)
        vd = (cl.pack_value_page(c2).flatten() != vb).nonzero().flatten()
        assert len(vd) == 32 and torch.equal(vd % 16, torch.full_like(vd, tok))


@pytest.mark.parametrize("kind", ["k", "v"])
def test_one_token_writes_equal_a_bulk_pack(kind):
    """Writing tokens one at a time into pages that hold other bytes (stale ones included) gives
    the page a bulk pack of all its rows gives."""
    P, H = 32, 2
    codes = _codes(3, H, P, 128, seed=3)
    pool = torch.randint(0, 256, (3, H, P, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    order = torch.randperm(3 * P, generator=torch.Generator().manual_seed(5))
    for k in order.tolist():
        page, row = torch.tensor([k // P]), torch.tensor([k % P])
        cl.write_code_rows(pool, page, row, codes[page, :, row], kind, 2)
    assert torch.equal(pool, cl.pack_page(codes, kind, 2))
    # a bulk write of several rows of one block at once
    pool2 = torch.zeros_like(pool)
    pages = torch.arange(3).repeat_interleave(P)
    rows = torch.arange(P).repeat(3)
    cl.write_code_rows(pool2, pages, rows, codes[pages, :, rows], kind, 2)
    assert torch.equal(pool2, pool)
    got = cl.read_code_rows(pool, pages, rows, kind, 2)
    assert torch.equal(got, codes[pages, :, rows])


def test_version_check_refuses_a_mismatch():
    check_cache_format_version(CACHE_FORMAT_VERSION, "here")
    with pytest.raises(ValueError, match="format version 1"):
        check_cache_format_version(1, "an old export")
