"""The byte order of INT-b codes in a history page (docs/cache-format.md), plain torch: the oracle.

A layer's code pools keep their shape, ``[N_q, H_kv, P, D * b / 8]`` uint8; what this module fixes
is which byte and bit pair of a (page, head) holds the code of (token row, channel). There are two
layouts, chosen by ``formats.cache.code_layout(bits, head_dim, page_size)``, both cache format
version ``formats.cache.CACHE_FORMAT_VERSION``:

- ``planar``: each token row packed on its own (``quant.pack_codes``): byte j of a row holds
  channels j, j + D/n, ... at bit offsets 0, b, ... (INT4, head_dim 64, pages that are not a
  multiple of 16 tokens);
- ``masked`` (INT2 at head_dim 128, pages of a multiple of 16 tokens): each 16-token block of a
  page is 512 bytes (its 16 rows of 32 bytes, read as one run) in the order of issue #32's decode
  on 8-bit integer wgmma, whose A fragment is a masked 32-bit word: ``w & (0x03030303 << 2j)``.
  With r the token row in the block (0..15) and c the channel (0..127):

  keys:   byte 128 q + 32 t + 8 s + 4 hh + b, bit pair j  <->  token r = 4 q + j,
          channel c = 32 s + 16 hh + 4 t + b;
  values: byte 16 (8 w + g) + 4 s + b,         bit pair j  <->  token r = 4 s + b,
          channel c = 16 w + g + 8 (j & 1) + 64 (j >> 1).

  Bit pair 3 stores (c + 2) mod 4 (the wgmma reads a byte as signed: the masked top pair is then
  64 (c - 2), an affine shift the kernel folds into the zero term); the map is its own inverse.
  A key byte holds one channel of 4 consecutive tokens (a one-token write changes one bit pair of
  each of 128 bytes and must keep the other three); a value byte holds 4 channels of one token
  (a token owns its 32 bytes).

Writers store a token with :func:`write_code_rows` (unpack the blocks it touches, set its codes,
pack them back: bitwise a pack of the whole block, whatever the other rows hold) and readers
decode rows with :func:`read_code_rows`; both take unpacked codes ``[n, H_kv, D]`` (0 .. 2^b - 1).
"""

from __future__ import annotations

import torch

from oscar_compile import quant
from oscar_compile.formats.cache import MASKED_BLOCK_TOKENS, MASKED_HEAD_DIM, code_layout

BLOCK = MASKED_BLOCK_TOKENS  # tokens of one masked block (16)
ROW_BYTES = MASKED_HEAD_DIM * 2 // 8  # 32: one token row of INT2 codes at head_dim 128
BLOCK_BYTES = BLOCK * ROW_BYTES  # 512


def key_byte_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(byte [16, 128], bit pair [16, 128]) int64: where the key code of (row r, channel c) lives.
    (Built on each call, not cached: a call under torch.export's tracing makes traced tensors.)"""
    r = torch.arange(BLOCK).view(BLOCK, 1)
    c = torch.arange(MASKED_HEAD_DIM).view(1, MASKED_HEAD_DIM)
    s, hh, t, b = c // 32, (c // 16) % 2, (c // 4) % 4, c % 4
    byte = 128 * (r // 4) + 32 * t + 8 * s + 4 * hh + b
    return byte, (r % 4).expand_as(byte).contiguous()


def value_byte_map() -> tuple[torch.Tensor, torch.Tensor]:
    """(byte [16, 128], bit pair [16, 128]) int64: where the value code of (row r, channel c) lives."""
    r = torch.arange(BLOCK).view(BLOCK, 1)
    c = torch.arange(MASKED_HEAD_DIM).view(1, MASKED_HEAD_DIM)
    w, g, j0, j1 = (c % 64) // 16, c % 8, (c // 8) % 2, c // 64
    byte = 16 * (8 * w + g) + r
    return byte, (j0 + 2 * j1).expand_as(byte).contiguous()


def _byte_map(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "k":
        return key_byte_map()
    if kind == "v":
        return value_byte_map()
    raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")


def _stored(codes: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """The stored value of a code in bit pair ``pair``: (c + 2) mod 4 in pair 3 (its own inverse)."""
    return torch.where(pair == 3, (codes + 2) % 4, codes)


def _pack_blocks(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """codes [..., 16, 128] (0..3) -> [..., 512] uint8 (one masked block)."""
    if codes.shape[-2:] != (BLOCK, MASKED_HEAD_DIM):
        raise ValueError(f"a masked block is [..., {BLOCK}, {MASKED_HEAD_DIM}] codes, got {tuple(codes.shape)}")
    byte, pair = (m.to(codes.device) for m in _byte_map(kind))
    bits = (_stored(codes.to(torch.int32), pair) << (2 * pair)).flatten(-2)  # [..., 2048]
    out = torch.zeros(*codes.shape[:-2], BLOCK_BYTES, dtype=bits.dtype, device=codes.device)
    out.scatter_add_(-1, byte.flatten().expand_as(bits), bits)  # 4 disjoint bit pairs per byte: sum == or
    return out.to(torch.uint8)


def unpack_blocks(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """[..., 512] uint8 -> codes [..., 16, 128] uint8. In uint8 ops only (a gather, a logical
    shift, an AND and an XOR: (c + 2) mod 4 is c ^ 2), so the ONNX step graph traces it as it is."""
    if packed.shape[-1] != BLOCK_BYTES:
        raise ValueError(f"a masked block is {BLOCK_BYTES} bytes, got {tuple(packed.shape)}")
    byte, pair = _byte_map(kind)
    shift = (2 * pair).flatten().to(device=packed.device, dtype=torch.uint8)
    top = torch.where(pair == 3, 2, 0).flatten().to(device=packed.device, dtype=torch.uint8)
    gathered = packed[..., byte.flatten().to(packed.device)]  # [..., 2048]
    codes = ((gathered >> shift) & 3) ^ top
    return codes.reshape(*packed.shape[:-1], BLOCK, MASKED_HEAD_DIM)


def _check_page(codes: torch.Tensor) -> None:
    if codes.dim() < 2 or codes.shape[-2] % BLOCK:
        raise ValueError(f"a masked page holds a multiple of {BLOCK} token rows, got {tuple(codes.shape)}")


def _pack_masked_page(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """Codes of whole pages [..., P, 128] (P a multiple of 16) -> the page bytes [..., P, 32]."""
    _check_page(codes)
    P = codes.shape[-2]
    blocks = codes.reshape(*codes.shape[:-2], P // BLOCK, BLOCK, MASKED_HEAD_DIM)
    return _pack_blocks(blocks, kind).reshape(*codes.shape[:-2], P, ROW_BYTES)


def _unpack_masked_page(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """Inverse of :func:`_pack_masked_page`: [..., P, 32] uint8 -> codes [..., P, 128] uint8."""
    _check_page(packed)
    P = packed.shape[-2]
    blocks = packed.reshape(*packed.shape[:-2], P // BLOCK, BLOCK_BYTES)
    return unpack_blocks(blocks, kind).reshape(*packed.shape[:-2], P, MASKED_HEAD_DIM)


def pack_key_page(codes: torch.Tensor) -> torch.Tensor:
    """Key codes of whole pages [..., P, 128] (P a multiple of 16) -> the page bytes [..., P, 32]."""
    return _pack_masked_page(codes, "k")


def pack_value_page(codes: torch.Tensor) -> torch.Tensor:
    """Value codes of whole pages [..., P, 128] -> the page bytes [..., P, 32]."""
    return _pack_masked_page(codes, "v")


def pack_page(codes: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    """Codes of whole pages [..., P, D] -> the page bytes [..., P, D * b / 8] in the layer's layout."""
    P, D = codes.shape[-2], codes.shape[-1]
    if code_layout(bits, D, P) == "planar":
        return quant.pack_codes(codes, bits)
    return _pack_masked_page(codes, kind)


def unpack_page(packed: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_page`: [..., P, D * b / 8] uint8 -> codes [..., P, D] uint8."""
    P, D = packed.shape[-2], packed.shape[-1] * 8 // bits
    if code_layout(bits, D, P) == "planar":
        return quant.unpack_codes(packed, bits)
    return _unpack_masked_page(packed, kind)


def read_code_rows(pool: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, kind: str, bits: int) -> torch.Tensor:
    """Codes [n, H_kv, D] uint8 of token rows ``rows`` of ``pages`` (both [n]) of a code pool
    [N_q, H_kv, P, D * b / 8]."""
    P, D = pool.shape[2], pool.shape[3] * 8 // bits
    if code_layout(bits, D, P) == "planar":
        return quant.unpack_codes(pool[pages, :, rows], bits)
    blocks = pool.view(pool.shape[0], pool.shape[1], P // BLOCK, BLOCK_BYTES)
    ids, inv = torch.unique(pages.long() * (P // BLOCK) + rows.long() // BLOCK, return_inverse=True)
    dense = unpack_blocks(blocks[ids // (P // BLOCK), :, ids % (P // BLOCK)], kind)  # [m, H, 16, 128]: each block once
    return dense[inv, :, rows.long() % BLOCK]


def write_code_rows(
    pool: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, codes: torch.Tensor, kind: str, bits: int
) -> None:
    """Store codes [n, H_kv, D] of token rows ``rows`` of ``pages`` (both [n], distinct (page, row)
    pairs) into a code pool in place. Masked blocks are unpacked, given the new rows and packed
    back, so the other tokens of a shared key byte keep their bit pairs exactly (as the Triton
    write's per-bit-pair AND / OR does)."""
    P, D = pool.shape[2], pool.shape[3] * 8 // bits
    if code_layout(bits, D, P) == "planar":
        pool[pages, :, rows] = quant.pack_codes(codes, bits)
        return
    if len(rows) == 0:
        return
    blocks = pool.view(pool.shape[0], pool.shape[1], P // BLOCK, BLOCK_BYTES)
    flat = pages.long() * (P // BLOCK) + rows.long() // BLOCK  # block id, [n]
    ids, inv = torch.unique(flat, return_inverse=True)
    bp, bb = ids // (P // BLOCK), ids % (P // BLOCK)
    dense = unpack_blocks(blocks[bp, :, bb], kind)  # [m, H, 16, 128]
    dense[inv, :, rows.long() % BLOCK] = codes.to(torch.uint8)
    blocks[bp, :, bb] = _pack_blocks(dense, kind)
