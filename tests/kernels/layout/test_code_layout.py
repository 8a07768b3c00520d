"""The masked INT2 page layout (kernels/layout/code_layout_ref.py) against the quantizer and the issue's formula,
and the Triton block reads (kernels/layout/code_layout_triton.py) against it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from oscar_compile import quant
from oscar_compile.formats.cache import CACHE_FORMAT_VERSION, check_cache_format_version, code_layout
from oscar_compile.kernels.attention.attention_blocks_triton import history_rows
from oscar_compile.kernels.layout import code_layout_ref as cl
from oscar_compile.kernels.layout.code_layout_triton import (
    join_key_pairs,
    load_masked_key_plane,
    load_masked_planar_bytes,
    load_masked_value_bytes,
    masked_block_rows,
    pair_code,
    value_columns,
)


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


@pytest.mark.parametrize("n0,hi", [(0, 64), (64, 70), (32, 200)])
def test_triton_block_reads_match_the_reference(tdevice, n0, hi):
    """The Triton reads of masked pages (code_layout_triton: whole 16-token blocks, key bit pairs
    joined into token order, value bit pairs in their channel order, and the planar bytes rebuilt
    from them) give, bitwise, the codes of read_code_rows and their planar packing; at page
    boundaries, and with the tile's tail past the history (a block partly in it, blocks wholly
    past it)."""
    P, H, BN = 32, 2, 64
    num_pages = 9
    codes = {kind: _codes(num_pages, H, P, 128, seed=7 + i) for i, kind in enumerate("kv")}
    pools = {kind: cl.pack_page(c, kind, 2).to(tdevice) for kind, c in codes.items()}
    table = torch.randperm(num_pages, generator=torch.Generator().manual_seed(6)).to(tdevice, torch.int32)
    got = {kind: torch.zeros(H, BN, 128, dtype=torch.uint8, device=tdevice) for kind in "kv"}
    planar = {kind: torch.zeros(H, BN, 32, dtype=torch.uint8, device=tdevice) for kind in "kv"}
    _read_tile[(H,)](
        pools["k"], pools["v"], table, got["k"], got["v"], planar["k"], planar["v"], n0, hi, H_KV=H, P=P, BN=BN
    )
    idx = torch.arange(n0, min(n0 + BN, hi))
    pages, rows = table.cpu().long()[idx // P], idx % P
    for kind in "kv":
        want = cl.read_code_rows(pools[kind].cpu(), pages, rows, kind, 2).transpose(0, 1)  # [H, n, 128]
        assert torch.equal(got[kind].cpu()[:, : len(idx)], want)
        assert torch.equal(planar[kind].cpu()[:, : len(idx)], quant.pack_codes(want, 2))


@triton.jit
def _read_tile(
    kc_ptr,
    vc_ptr,
    table_ptr,
    kout_ptr,
    vout_ptr,
    kpl_ptr,
    vpl_ptr,
    n0,
    hi,
    H_KV: tl.constexpr,
    P: tl.constexpr,
    BN: tl.constexpr,
):
    """History tokens n0 .. n0 + BN (< hi) of KV head program_id(0): their codes [BN, 128] and
    planar bytes [BN, 32], read as the attention kernel and the extend path's dequantization do."""
    h = tl.program_id(0)
    rows, ok = history_rows(table_ptr, n0, hi, h, H_KV, P, BN)
    blk = masked_block_rows(rows, BN)
    n = (h * BN + tl.arange(0, BN))[:, None]
    j = tl.arange(0, 32)[None, :]
    for s in tl.static_range(4):
        kp = load_masked_key_plane(kc_ptr, blk, s)
        d = join_key_pairs(pair_code(kp, 0), pair_code(kp, 1), pair_code(kp, 2), pair_code(kp, 3))
        tl.store(kout_ptr + n * 128 + 32 * s + j, d, mask=ok[:, None])
    vb = load_masked_value_bytes(vc_ptr, blk)
    for pr in tl.static_range(4):
        tl.store(vout_ptr + n * 128 + value_columns(pr, 32, True)[None, :], pair_code(vb, pr), mask=ok[:, None])
    tl.store(kpl_ptr + n * 32 + j, load_masked_planar_bytes(kc_ptr, blk, True), mask=ok[:, None])
    tl.store(vpl_ptr + n * 32 + j, load_masked_planar_bytes(vc_ptr, blk, False), mask=ok[:, None])
